"""The dual kernel's TMA ring (glm5lab.kernels.tma_ring, NOTES.md v43) on the CPU: where TMA lands a row's bytes, the
view the consumers read them through, the layout that carries that view, what its loads cost in bank conflicts, and
the descriptors. The kernel itself runs on the GPU only (tests/test_sparse_mla_sm90.py)."""
from types import SimpleNamespace

import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.kernels import tma_ring

ROWS = 64


def test_row_places_are_a_permutation_and_the_loaders_formula():
    """Row r's 512-byte place: r with bit 0 replaced by parity(r & 0b101), a permutation of the step's rows, and
    what the loader computes inline (`_fp8_dual_tma_loader`: r ^ ((r >> 2) & 1))."""
    places = [tma_ring.row_place(r) for r in range(ROWS)]
    assert sorted(places) == list(range(ROWS))
    assert places == [r ^ ((r >> 2) & 1) for r in range(ROWS)]
    assert [p & 1 for p in places] == [bin(r & 0b101).count("1") & 1 for r in range(ROWS)]


def test_the_consumers_view_reads_the_byte_tma_landed_there():
    """Simulated landing (a stage's bytes as TMA's 128-byte swizzle writes each row's four lines at its place) read
    back through the consumers' view: view column c of row r holds the row's byte `view_column(c)`, a 16-byte-unit
    permutation within its chunk (XOR the chunk), which q's staging and O's stores undo."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randint(0, 256, (ROWS, 512), generator=gen, dtype=torch.int32)
    stage = torch.full((ROWS * 512,), -1, dtype=torch.int32)
    land = torch.tensor([[tma_ring.landing_offset(r, b) for b in range(512)] for r in range(ROWS)])
    stage[land.flatten()] = rows.flatten()
    assert int((stage < 0).sum()) == 0                                   # every byte of the stage written once
    view = torch.tensor([[tma_ring.view_offset(r, c) for c in range(512)] for r in range(ROWS)])
    held = torch.tensor([tma_ring.view_column(c) for c in range(512)])
    assert torch.equal(stage[view], rows[:, held])
    assert sorted(held.tolist()) == list(range(512))
    assert all(held[c] // 128 == c // 128 and held[c] % 16 == c % 16 for c in range(512))   # within the chunk, by unit
    assert held[128 + 16 * 2 + 3] == 128 + 16 * 3 + 3 and held[384] == 384 + 48


def test_the_stage_layout_is_the_view():
    """latent_stage_layout's bases (offset bit -> [row, column]) compose, XOR-wise, to the view's offsets for every
    byte of a stage; chunk j's columns lie at offset j * 128 from chunk 0's, so a column slice of the layout is a
    plain translation (what Triton accepts)."""
    layout = tma_ring.latent_stage_layout(ROWS)
    bases = layout.offset_bases
    assert len(bases) == 15
    for off in range(ROWS * 512):
        r = c = 0
        for bit, (br, bc) in enumerate(bases):
            if off >> bit & 1:
                r, c = r ^ br, c ^ bc
        assert tma_ring.view_offset(r, c) == off
    assert [bases[7], bases[8]] == [[0, 128], [0, 256]]
    with pytest.raises(Glm5labError, match="power of two of >= 8 rows"):
        tma_ring.latent_stage_layout(48)


def test_the_consumers_loads_pay_2_way_bank_conflicts_on_the_view():
    """Triton's own bank count of the dual consumers' K and V^T e4m3 loads on a chunk of the view: 2-way each (one
    excess access a wavefront), where the cp.async ring's layout has none -- the price of TMA's swizzle, which the
    places halve for V^T (4-way with row r at place r; NOTES.md v42)."""
    pytest.importorskip("triton._C.libtriton")
    from glm5lab.bench.tma_gather_probe import _chunk_layout, consumer_bank_conflicts

    chunk = _chunk_layout(lambda r, c: (r << 7) | (tma_ring.view_offset(r, c) & 127))   # (banks: address bits 2-6)
    plain = _chunk_layout(lambda r, c: (r << 7) | (c ^ ((r & 1) << 6)))              # (row r at place r)
    counts = consumer_bank_conflicts({"view": chunk, "place r": plain})
    assert counts["view"] == {"K": 1, "V^T": 1}
    assert counts["place r"] == {"K": 1, "V^T": 3}


def test_descriptors_and_their_swizzle():
    """Two descriptors over the cache's bytes (a row's latent part as [4, 128], its rope part one 128-byte box),
    refused for caches TMA cannot address; the launcher's metadata of both gets the 128-byte swizzle, and metadata
    of another shape is refused rather than patched blindly."""
    cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
    lat, rope = tma_ring.descriptors(cache, 256, 656)
    assert (lat.shape, lat.strides, lat.block_shape) == ([256, 4, 128], [656, 128, 1], [1, 4, 128])
    assert (rope.shape, rope.strides, rope.block_shape) == ([256, 656], [656, 1], [1, 128])
    with pytest.raises(Glm5labError, match="16-byte aligned rows"):
        tma_ring.descriptors(cache.view(torch.bfloat16), 256, 328)
    with pytest.raises(Glm5labError, match="TMA coordinates are 32-bit"):
        tma_ring.descriptors(cache, 2**31, 656)
    meta = [{"block_size": [1, 4, 128], "swizzle": 0}, {"block_size": [1, 128], "swizzle": 0}]
    compiled = SimpleNamespace(metadata=SimpleNamespace(tensordesc_meta=meta))
    tma_ring.swizzle_descriptors(compiled)
    assert [m["swizzle"] for m in meta] == [tma_ring.SWIZZLE_128B] * 2
    compiled.metadata.tensordesc_meta = [{"block_size": [1, 128], "swizzle": 0}]
    with pytest.raises(Glm5labError, match="unexpected TMA descriptor metadata"):
        tma_ring.swizzle_descriptors(compiled)
