"""glm5lab's paged dense MLA decode kernel (glm5lab.kernels.paged_mla_decode) against the float64 torch
reference `dense_mla_reference`.

Tolerances. The reference runs in float64 on the SAME (already fp16/bf16-rounded) q and cache, so input
rounding is not an error source. What the kernel adds: (1) scores are exact products summed in fp32
(relative ~1e-6); (2) the softmax weights P are rounded to the cache dtype before P @ V (flash-attention
practice; bf16 keeps 8 bits, relative error <= 2^-9 per weight); (3) the output is rounded to its dtype
(bf16: half an ulp = 2^-9 relative, 0.008 at |out| = 4). So out: atol = rtol = 2e-2 for bf16 (about
10x the worst single rounding), 5e-3 for fp16 (3 more mantissa bits), 1e-5 for fp32; lse comes only from
fp32 scores and sums: atol 1e-3 for fp16/bf16 and 1e-5 for fp32.
"""
from __future__ import annotations

import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.kernels.paged_mla_decode import merge_partials, paged_mla_decode
from glm5lab.sparse.reference import dense_mla_reference, mla_softmax_scale

# dtype -> (out atol/rtol, lse atol). The lse is float32 in the kernel whatever q's dtype, and 16-bit operands'
# products are exact in float32, so it differs from the float64 reference by float32 summation only (~5e-7 measured
# on these inputs): 2e-5, the sparse kernel's bound. One dropped key of weight p moves the lse by ~p, far more.
TOL = {
    torch.bfloat16: (2e-2, 2e-5),
    torch.float16: (5e-3, 2e-5),
    torch.float32: (1e-5, 1e-5),
}
SCALE = mla_softmax_scale()  # GLM-5: 1/sqrt(192 + 64)


def _case(seed, *, rows, heads, page, num_blocks, max_blocks, dtype, latent=512, rope=64, seq_lens=None):
    g = torch.Generator().manual_seed(seed)
    width = latent + rope
    kv = torch.randn(num_blocks, page, width, generator=g).to(dtype)
    q = torch.randn(rows, heads, width, generator=g).to(dtype)
    bt = torch.randint(0, num_blocks, (rows, max_blocks), generator=g, dtype=torch.int32)
    if seq_lens is None:
        seq_lens = torch.randint(1, max_blocks * page + 1, (rows,), generator=g, dtype=torch.int32)
    return q, kv, bt, torch.as_tensor(seq_lens, dtype=torch.int32)


def _poisoned(rows, heads, latent, dtype):
    return (torch.full((rows, heads, latent), float("nan"), dtype=dtype),
            torch.full((rows, heads), float("nan"), dtype=torch.float32))


def _check(out, lse, q, kv, bt, sl, dtype, latent=512):
    ref_out, ref_lse = dense_mla_reference(q, kv, bt, sl, SCALE, latent)
    tol_o, tol_l = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol_o, rtol=tol_o)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol_l, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page,splits", [(1, 1), (16, 1), (64, 3), (3, 2)])
def test_matches_dense_reference(dtype, page, splits):
    max_blocks = max(2, 70 // page)
    q, kv, bt, sl = _case(1000 * page + splits, rows=3, heads=5, page=page, num_blocks=9,
                          max_blocks=max_blocks, dtype=dtype)
    sl[0] = max_blocks * page  # one row uses its whole table
    out, lse = _poisoned(3, 5, 512, dtype)
    paged_mla_decode(q, kv, bt, sl, SCALE, 512, num_splits=splits, out=out, lse=lse)
    _check(out, lse, q, kv, bt, sl, dtype)


@pytest.mark.parametrize("splits", [1, 4])
def test_empty_rows_give_zero_and_minus_inf(splits):
    q, kv, bt, _ = _case(7, rows=4, heads=3, page=16, num_blocks=4, max_blocks=2, dtype=torch.bfloat16)
    sl = torch.tensor([0, 5, 0, 32], dtype=torch.int32)
    out, lse = _poisoned(4, 3, 512, torch.bfloat16)
    paged_mla_decode(q, kv, bt, sl, SCALE, 512, num_splits=splits, out=out, lse=lse)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[[0, 2]]).all()
    _check(out, lse, q, kv, bt, sl, torch.bfloat16)


@pytest.mark.parametrize("latent,rope,heads", [(40, 8, 17), (64, 0, 2), (128, 64, 1)])
def test_small_and_odd_widths_and_head_counts(latent, rope, heads):
    """Odd latent/rope widths (masked tiles), no rope at all, 17 heads (two head blocks of 16)."""
    q, kv, bt, sl = _case(latent + rope + heads, rows=3, heads=heads, page=4, num_blocks=6, max_blocks=5,
                          dtype=torch.float16, latent=latent, rope=rope)
    out, lse = paged_mla_decode(q, kv, bt, sl, SCALE, latent, block_h=16)
    _check(out, lse, q, kv, bt, sl, torch.float16, latent)


def test_non_contiguous_inputs_and_int64_tables():
    q, kv, bt, sl = _case(11, rows=3, heads=8, page=8, num_blocks=6, max_blocks=4, dtype=torch.bfloat16)
    q_nc = q[:, ::2]                                   # every other head: a strided view
    bt_nc = bt.t().contiguous().t().long()             # column-major int64 block table
    sl64 = sl.long()
    out, lse = paged_mla_decode(q_nc, kv, bt_nc, sl64, SCALE, 512)
    _check(out, lse, q_nc, kv, bt_nc, sl64, torch.bfloat16)


def test_merge_partials_equals_one_pass():
    """Split-KV merge: splitting the keys in two and merging equals one softmax over all of them."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 10, generator=g, dtype=torch.float64)
    values = torch.randn(10, 6, generator=g, dtype=torch.float64)
    parts_o, parts_l = [], []
    for sl in (slice(0, 4), slice(4, 10), slice(10, 10)):  # the last split is empty
        s = scores[..., sl]
        lse = torch.logsumexp(s, -1)
        parts_l.append(lse)
        parts_o.append(torch.nan_to_num(torch.softmax(s, -1) @ values[sl]) if s.shape[-1] else
                       torch.zeros(2, 3, 6, dtype=torch.float64))
    out, lse = merge_partials(torch.stack(parts_o, -2), torch.stack(parts_l, -1))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


# each bad input and the words its error must use to name it
BAD_INPUTS = {
    "q_dim": r"q must be \[rows, heads, D\], got shape \(2, 576\)",
    "kv_dim": r"kv_cache must be \[blocks, page_size, D\]",
    "dtype_mismatch": r"share one dtype .* got torch.float16 and torch.bfloat16",
    "int_dtype": r"one dtype of float16/bfloat16/float32, got torch.int8",
    "width": r"q width 500 != kv row width 576",
    "rank": r"kv_lora_rank 600 out of range",
    "bt_rows": r"block_table must be \[rows=2, max_blocks\], got shape \(1, 2\)",
    "bt_dtype": r"block_table must be int32 or int64, got torch.float32",
    "seq_dtype": r"seq_lens must be int32 or int64, got torch.float32",
    "too_long": r"seq_len 9 needs more than the block table's 2 blocks",
    "block_id": r"block ids in \[0, 3\], outside the cache's 3 blocks",
    "negative_len": r"seq_lens must be >= 0",
    "out_shape": r"out must be .* shape \(2, 2, 512\).* got .*\(2, 2, 511\)",
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_raise_one_line_error(bad):
    q, kv, bt, sl = _case(5, rows=2, heads=2, page=4, num_blocks=3, max_blocks=2, dtype=torch.float16)
    kwargs = {}
    if bad == "q_dim":
        q = q[0]
    elif bad == "kv_dim":
        kv = kv.reshape(-1, kv.shape[-1])
    elif bad == "dtype_mismatch":
        kv = kv.bfloat16()
    elif bad == "int_dtype":
        q, kv = q.to(torch.int8), kv.to(torch.int8)
    elif bad == "width":
        q = q[..., :500]
    elif bad == "rank":
        kwargs["kv_lora_rank"] = 600
    elif bad == "bt_rows":
        bt = bt[:1]
    elif bad == "bt_dtype":
        bt = bt.float()
    elif bad == "seq_dtype":
        sl = sl.float()
    elif bad == "too_long":
        sl = torch.tensor([9, 1], dtype=torch.int32)
    elif bad == "block_id":
        bt = bt.clone()
        bt[1, 0] = 3
    elif bad == "negative_len":
        sl = torch.tensor([-1, 1], dtype=torch.int32)
    elif bad == "out_shape":
        kwargs["out"] = torch.empty(2, 2, 511, dtype=torch.float16)
    with pytest.raises(Glm5labError, match=BAD_INPUTS[bad]) as err:
        paged_mla_decode(q, kv, bt, sl, SCALE, **kwargs)
    assert "\n" not in str(err.value)


def test_unused_block_ids_are_not_checked_or_read():
    """Entries past seq_len may hold anything (vLLM leaves stale ids there): never read, never rejected."""
    q, kv, bt, _ = _case(9, rows=2, heads=2, page=4, num_blocks=3, max_blocks=3, dtype=torch.float16)
    sl = torch.tensor([4, 6], dtype=torch.int32)
    bt = bt.clone()
    bt[0, 1:] = 10**6
    bt[1, 2] = -7
    out, lse = paged_mla_decode(q, kv, bt, sl, SCALE)
    _check(out, lse, q, kv, bt.clamp(0, 2), sl, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [1, 64])
def test_gpu_full_size(dtype, page):
    rows, heads, ctx = 8, 64, 4096
    q, kv, bt, sl = _case(page, rows=rows, heads=heads, page=page, num_blocks=(rows * ctx) // page,
                          max_blocks=ctx // page, dtype=dtype)
    q, kv, bt, sl = (t.cuda() for t in (q, kv, bt, sl))
    sl[0] = 0
    out, lse = paged_mla_decode(q, kv, bt, sl, SCALE)
    torch.cuda.synchronize()
    _check(out.cpu(), lse.cpu(), q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), dtype)
