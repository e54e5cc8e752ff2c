"""The torch references every kernel is checked against (glm5lab.sparse.reference): against a naive
Python loop, against un-absorbed MLA attention (why the scale is 1/sqrt(192 + 64)), sparse == dense when
the top-k covers the context, -1 anywhere, empty rows, and clear errors."""
from __future__ import annotations

import math

import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.sparse.reference import (
    dense_mla_reference,
    flatten_kv_cache,
    mla_softmax_scale,
    sparse_mla_reference,
)


def _rand(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _naive(q, kv_flat, slots, scale, latent):
    """One token, one head, one slot at a time, in Python floats' precision (float64)."""
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, latent, dtype=torch.float64)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64)
    for t in range(tokens):
        chosen = [int(s) for s in slots[t] if int(s) >= 0]
        for h in range(heads):
            if not chosen:
                continue
            scores = [float(q[t, h].double() @ kv_flat[s].double()) * scale for s in chosen]
            m = max(scores)
            weights = [math.exp(x - m) for x in scores]
            total = sum(weights)
            lse[t, h] = m + math.log(total)
            for w, s in zip(weights, chosen):
                out[t, h] += (w / total) * kv_flat[s, :latent].double()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_naive_loop(dtype):
    q = _rand(0, 3, 2, 24).to(dtype)
    kv = _rand(1, 5, 4, 24).to(dtype)              # 20 slots, paged layout
    slots = torch.tensor([[3, -1, 19, 3, 0], [-1, -1, -1, -1, -1], [-1, 7, 8, -1, 12]])
    out, lse = sparse_mla_reference(q, kv, slots, 0.3, kv_lora_rank=16)
    ref_out, ref_lse = _naive(q, flatten_kv_cache(kv), slots, 0.3, 16)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_absorbed_form_equals_unabsorbed_mla_with_model_scale():
    """q_nope . (W_uk c) == (W_uk^T q_nope) . c, so the absorbed 576-wide dot product needs the model's
    scale 1/sqrt(qk_nope + qk_rope) = 1/sqrt(192 + 64), not 1/sqrt(576). Small widths, same algebra."""
    heads, nope, rope, latent, v_dim, n_kv = 3, 12, 4, 10, 6, 7
    c = _rand(2, n_kv, latent)                     # latent cache rows
    k_pe = _rand(3, n_kv, rope)
    w_uk = _rand(4, heads, nope, latent)
    w_uv = _rand(5, heads, v_dim, latent)
    q_nope, q_pe = _rand(6, 1, heads, nope), _rand(7, 1, heads, rope)
    scale = mla_softmax_scale(nope, rope)
    # un-absorbed: per-head keys [W_uk c, k_pe], values W_uv c
    k = torch.cat([torch.einsum("hnl,sl->hsn", w_uk, c), k_pe.expand(heads, -1, -1)], -1)
    v = torch.einsum("hvl,sl->hsv", w_uv, c)
    q_full = torch.cat([q_nope, q_pe], -1)[0]      # [H, nope + rope]
    probs = torch.softmax(torch.einsum("hd,hsd->hs", q_full, k) * scale, -1)
    expected = torch.einsum("hs,hsv->hv", probs, v)
    # absorbed: q' = [W_uk^T q_nope, q_pe] against rows [c, k_pe], then W_uv on the latent output
    q_abs = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe], -1)
    kv = torch.cat([c, k_pe], -1)
    slots = torch.arange(n_kv)[None]
    out, _ = sparse_mla_reference(q_abs, kv, slots, scale, kv_lora_rank=latent)
    got = torch.einsum("hl,hvl->hv", out[0], w_uv)
    torch.testing.assert_close(got, expected)
    wrong, _ = sparse_mla_reference(q_abs, kv, slots, 1 / math.sqrt(latent + rope), kv_lora_rank=latent)
    assert not torch.allclose(torch.einsum("hl,hvl->hv", wrong[0], w_uv), expected)


def test_glm5_scale_and_yarn_mscale():
    assert mla_softmax_scale() == pytest.approx(1 / math.sqrt(192 + 64))
    assert mla_softmax_scale(192, 64, mscale=1.5) == pytest.approx(2.25 / math.sqrt(256))


def test_sparse_equals_dense_when_topk_covers_context():
    """Top-k >= context: the selected set is the whole context (any order, -1 anywhere), so sparse
    attention over it is dense attention."""
    g = torch.Generator().manual_seed(8)
    page, blocks = 4, 6
    kv = _rand(9, blocks, page, 40)
    q = _rand(10, 3, 2, 40)
    block_table = torch.randperm(blocks, generator=g)[:6].reshape(3, 2).int()
    seq_lens = torch.tensor([5, 8, 1], dtype=torch.int32)
    topk = 11
    slots = torch.full((3, topk), -1)
    for r in range(3):
        n = int(seq_lens[r])
        j = torch.arange(n)
        full = block_table[r, j // page].long() * page + j % page
        pos = torch.randperm(topk, generator=g)[:n]          # scattered, -1 in between
        slots[r, pos] = full[torch.randperm(n, generator=g)]
    s_out, s_lse = sparse_mla_reference(q, kv, slots, 0.2, kv_lora_rank=32)
    d_out, d_lse = dense_mla_reference(q, kv, block_table, seq_lens, 0.2, kv_lora_rank=32)
    torch.testing.assert_close(s_out, d_out)
    torch.testing.assert_close(s_lse, d_lse)


def test_minus_one_anywhere_and_order_do_not_matter():
    q = _rand(11, 2, 3, 16)
    kv = _rand(12, 30, 16)                          # flat [slots, D] layout
    a = torch.tensor([[4, 9, 20, 1], [0, 29, 3, 3]])
    b = torch.tensor([[-1, 20, -1, 1, 4, -1, 9], [3, -1, 29, 0, -1, -1, 3]])
    oa, la = sparse_mla_reference(q, kv, a, 0.5, kv_lora_rank=12)
    ob, lb = sparse_mla_reference(q, kv, b, 0.5, kv_lora_rank=12)
    torch.testing.assert_close(oa, ob)
    torch.testing.assert_close(la, lb)


def test_duplicates_count_twice():
    q = _rand(13, 1, 1, 8)
    kv = _rand(14, 4, 8)
    out, lse = sparse_mla_reference(q, kv, torch.tensor([[2, 2, 1]]), 1.0, kv_lora_rank=8)
    s = (kv[[2, 1]] @ q[0, 0]).double()
    w = torch.tensor([2 * math.exp(s[0]), math.exp(s[1])], dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0], torch.log(w.sum()))
    torch.testing.assert_close(out[0, 0], (w[0] * kv[2] + w[1] * kv[1]) / w.sum())


def test_empty_rows_and_empty_batch():
    q = _rand(15, 3, 2, 16)
    kv = _rand(16, 10, 16)
    slots = torch.tensor([[-1, -1], [5, -1], [-1, -1]], dtype=torch.int32)
    out, lse = sparse_mla_reference(q, kv, slots, 0.5, kv_lora_rank=8)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[[0, 2]], torch.zeros(2, 2, 8, dtype=torch.float64))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()
    torch.testing.assert_close(out[1], kv[5, :8].expand(2, 8))   # one slot: weight 1
    out0, lse0 = sparse_mla_reference(q[:0], kv, slots[:0], 0.5, kv_lora_rank=8)
    assert out0.shape == (0, 2, 8) and lse0.shape == (0, 2)
    d_out, d_lse = dense_mla_reference(q[:0], kv.reshape(5, 2, 16), torch.zeros(0, 3, dtype=torch.int32),
                                       torch.zeros(0, dtype=torch.int32), 0.5, kv_lora_rank=8)
    assert d_out.shape == (0, 2, 8)


def test_float32_compute_dtype():
    q, kv = _rand(17, 2, 2, 16), _rand(18, 9, 16)
    slots = torch.tensor([[0, 3, -1], [8, 8, 1]])
    o32, l32 = sparse_mla_reference(q, kv, slots, 0.5, kv_lora_rank=8, compute_dtype=torch.float32)
    o64, l64 = sparse_mla_reference(q, kv, slots, 0.5, kv_lora_rank=8)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l32.double(), l64, atol=1e-5, rtol=1e-5)


# each bad input and the words its error must use to name it
BAD_INPUTS = {
    "q_dim": r"q must be \[tokens, heads, D\], got shape \(2, 16\)",
    "width": r"q width 16 != kv row width 15",
    "rank": r"kv_lora_rank 17 out of range for width 16",
    "slots_rows": r"slots must be \[tokens=2, topk\], got shape \(1, 2\)",
    "slots_dim": r"slots must be \[tokens=2, topk\], got shape \(2,\)",
    "slots_dtype": r"slots must be int32 or int64, got torch.float32",
    "beyond": r"slot index 12 is beyond the cache \(12 slots\)",
    "kv_dim": r"kv_cache must be .* got shape \(1, 3, 4, 16\)",
    "dense_flat": r"dense_mla_reference needs the paged layout",
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_raise_one_line_error(bad):
    q, kv = _rand(19, 2, 2, 16), _rand(20, 3, 4, 16)
    slots = torch.tensor([[0, 1], [2, -1]])
    if bad == "dense_flat":
        with pytest.raises(Glm5labError, match=BAD_INPUTS[bad]):
            dense_mla_reference(q, kv.reshape(12, 16), torch.zeros(2, 1, dtype=torch.int32),
                                torch.ones(2, dtype=torch.int32), 0.5, kv_lora_rank=8)
        return
    kwargs = {"kv_lora_rank": 8}
    if bad == "q_dim":
        q = q[0]
    elif bad == "width":
        kv = kv[..., :15]
    elif bad == "rank":
        kwargs["kv_lora_rank"] = 17
    elif bad == "slots_rows":
        slots = slots[:1]
    elif bad == "slots_dim":
        slots = slots[0]
    elif bad == "slots_dtype":
        slots = slots.float()
    elif bad == "beyond":
        slots = torch.tensor([[0, 12], [2, -1]])
    elif bad == "kv_dim":
        kv = kv[None]
    with pytest.raises(Glm5labError, match=BAD_INPUTS[bad]) as err:
        sparse_mla_reference(q, kv, slots, 0.5, **kwargs)
    assert "\n" not in str(err.value)
