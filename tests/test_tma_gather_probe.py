"""The TMA gather probe (glm5lab.bench.tma_gather_probe): its kernel's sm90 build (offline, no GPU), its refusals, and
on the GPU that the rows it gathers are the cache's rows (zeros where a slot is -1 or past the cache)."""
import pytest
import torch

from glm5lab.bench import tma_gather_probe as probe
from glm5lab.errors import Glm5labError
from tests.offline_build import sass_report


def test_probe_kernel_builds_one_tma_copy_a_box_and_fits_two_ctas_a_sm():
    """sm90 build of every box plan (with the check's stores): the loader warps' step issues 64 rows x (3 or 6) TMA
    copies and nothing else moves the rows (no cp.async); no spill, at most 128 registers and under half the SM's
    shared memory, so two CTAs share a SM as in the paired kernels the probe is compared with."""
    plans = sorted(probe.PLANS)
    for plan, res in zip(plans, sass_report(*({"tma_probe": True, "plan": p, "check": True} for p in plans))):
        boxes = probe.PLANS[plan][0]
        rep = res["report"]
        assert rep["UTMALDG"] == probe.BLOCK_N.value * boxes, rep     # (every loader warp's, in the report's loop)
        assert "LDGSTS" not in rep and rep["stack"] == 0 and rep["regs"] <= 128
        assert rep["smem"] <= 227 * 1024 // 2 - 1024


def test_probe_refuses_an_unknown_plan_and_a_cache_not_viewed_as_rows_of_164_words():
    cache = torch.zeros(64, 164, dtype=torch.int32)
    slots = torch.zeros(2, 64, dtype=torch.int32)
    with pytest.raises(Glm5labError, match="unknown TMA box plan 'rows4'"):
        probe.tma_gather(cache, slots, "rows4")
    with pytest.raises(Glm5labError, match=r"int32 \[slots, 164\]"):
        probe.tma_gather(cache.view(torch.uint8), slots)
    with pytest.raises(Glm5labError, match="slots must be int32"):
        probe.tma_gather(cache, slots.long())


@pytest.mark.gpu
@pytest.mark.parametrize("plan", sorted(probe.PLANS))
@pytest.mark.parametrize("topk", [77, 1000, 2048])
def test_gpu_probe_gathers_the_cache_rows_with_zeros_for_invalid_slots(plan, topk):
    """Random rows of a random cache, with -1 anywhere in a row and slots past the cache: every gathered word is the
    cache's (or zero), in an output poisoned before the call; odd top-k ends in a partial step."""
    gen = torch.Generator(device="cuda").manual_seed(topk)
    num_slots = 4099
    cache = torch.randint(-2**31, 2**31 - 1, (num_slots, 164), device="cuda", dtype=torch.int32, generator=gen)
    slots = torch.randint(0, num_slots, (5, topk), device="cuda", dtype=torch.int32, generator=gen)
    holes = torch.rand(5, topk, device="cuda", generator=gen)
    slots[holes < 0.1] = -1
    slots[holes > 0.95] = num_slots + 7
    slots[3] = -1                                   # a token with no valid row
    out = torch.full((5, topk, 164), 0x7FC00001, device="cuda", dtype=torch.int32)
    got = probe.tma_gather(cache, slots, plan, out=out, check=True)
    torch.cuda.synchronize()
    ok = (slots >= 0) & (slots < num_slots)
    want = cache[slots.clamp(0, num_slots - 1).long()] * ok[..., None]
    assert torch.equal(got, want)


def test_consumer_loads_bank_conflicts_on_the_ring_and_on_rows_as_tma_lands_them():
    """Triton's own bank count for the consumers' e4m3 loads (K: DUAL_K8, V^T: DUAL_V8) from a latent chunk: none on
    the kernels' ring (its XOR by row), and on 512-byte rows as a one-box TMA copy lands them (rows3s) 2-way for K and
    4-way for V^T; a row placement by parity takes V^T to 2-way and no placement does better, since the swizzle can
    tell only odd places from even ones (NOTES.md v42)."""
    counts = probe.consumer_bank_conflicts()
    assert counts["ring (ROWS_SM8)"] == {"K": 0, "V^T": 0}
    assert counts["rows3s"] == {"K": 1, "V^T": 3}
    placed = {name: c for name, c in counts.items() if "mask" in name}
    assert len(placed) == probe.BLOCK_N.value // 2 - 1
    assert min(c["K"] + c["V^T"] for c in placed.values()) == 2
    assert counts["rows3s, parity mask 0x5"] == {"K": 1, "V^T": 1}     # row r's place parity: bit 0 ^ bit 2
    with pytest.raises(Glm5labError, match="parity_mask must be odd"):
        probe.tma_row_layout(4)


def test_gathers_alone_is_the_default_tiles_loader_diagnostic_at_each_size():
    """The probe's "default-d3" form: the default tile at that size (dual one CTA a SM at one wave, paired beyond) with
    its gathers alone, a configuration the kernel accepts (check_tile), without the consumer-only options."""
    from glm5lab.kernels.sparse_mla_sm90 import default_config

    for heads, tokens in ((8, 128), (16, 128), (16, 512)):
        cfg = probe.gathers_alone(heads, tokens)
        default = default_config(heads, True, tokens)
        assert cfg["ws_diag"] == 3 and cfg["_diagnostic"] is True and not cfg["kept_p"]
        assert (cfg["paired"], cfg["stages"], cfg["block_h"]) == (default["paired"], default["stages"],
                                                                    default["block_h"])
        assert default["pipe"].startswith(cfg["pipe"]) and not set(cfg["pipe"]) & set("fh")
    assert probe.gathers_alone(16, 512)["paired"] and not probe.gathers_alone(16, 128)["paired"]
