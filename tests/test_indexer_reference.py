"""The torch reference of GLM-5's DSA indexer against transformers' own GlmMoeDsaIndexer on the tiny model,
plus the pieces it is built from (interleaved rope, top-k with -1 padding, the tie rule checker)."""
import math

import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.sparse.indexer_reference import (IndexerWeights, apply_interleaved_rope, head_weights,
                                              indexer_keys, indexer_logits_reference, indexer_queries,
                                              indexer_reference, indexer_topk_reference, topk_set_is_valid,
                                              topk_sets_agree)


@pytest.fixture(scope="module")
def tiny_indexer_calls():
    """Run the tiny model on a 64-token prompt and record, for every layer's indexer, its inputs and the
    top-k transformers computed."""
    from glm5lab.model.tiny import build_tiny_model

    model = build_tiny_model(seed=0)
    calls = []

    def hook(module, args, kwargs, output):
        hidden, q_resid = args[0], args[1]
        calls.append({"module": module, "hidden": hidden.detach()[0], "q_resid": q_resid.detach()[0],
                      "topk": output.detach()[0]})

    handles = [layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True)
               for layer in model.model.layers if layer.self_attn.indexer is not None]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=gen)
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    assert len(calls) == len(handles) >= 1
    return model.config, calls


def test_reference_topk_equals_transformers_indexer(tiny_indexer_calls):
    config, calls = tiny_indexer_calls
    k = config.index_topk
    T = calls[0]["hidden"].shape[0]
    assert T > k, "the prompt must be longer than index_topk so the top-k is a strict subset"
    for layer, call in enumerate(calls):
        w = IndexerWeights.from_hf(call["module"], config)
        out = indexer_reference(w, call["hidden"], call["q_resid"])
        hf = call["topk"]                                   # [T, min(k, T)], may hold masked positions
        exact_rows = 0
        for t in range(T):
            ours = {i for i in out.topk[t].tolist() if i >= 0}
            theirs = {i for i in hf[t].tolist() if i <= t}  # positions after t were masked to -inf
            assert len(ours) == min(k, t + 1)
            if ours == theirs:
                exact_rows += 1
            else:  # only a near-tie at the k-th score may differ: check both sets against the rule
                tol = 1e-5 * float(out.logits[t, : t + 1].abs().max())
                for name, s in (("reference", ours), ("transformers", theirs)):
                    ok, why = topk_set_is_valid(torch.tensor(sorted(s)), out.logits[t], k, t + 1, atol=tol)
                    assert ok, f"layer {layer} row {t} {name}: {why}"
        assert exact_rows >= T - 2, f"layer {layer}: only {exact_rows}/{T} rows identical"
        # the last rows really select a strict subset of their context
        assert int((out.topk[-1] >= 0).sum()) == k < T


def test_reference_intermediates_have_model_shapes(tiny_indexer_calls):
    config, calls = tiny_indexer_calls
    w = IndexerWeights.from_hf(calls[0]["module"], config)
    out = indexer_reference(w, calls[0]["hidden"], calls[0]["q_resid"])
    T = calls[0]["hidden"].shape[0]
    assert out.q.shape == (T, config.index_n_heads, config.index_head_dim)
    assert out.k.shape == (T, config.index_head_dim)
    assert out.weights.shape == (T, config.index_n_heads)
    assert torch.isneginf(out.logits.triu(1)[out.logits.triu(1) != 0]).all()
    assert torch.isfinite(out.logits.tril()).all()


def test_interleaved_rope_is_a_rotation_of_pairs():
    """Independent of transformers: pair (x0, x1) is the complex number x0 + i x1 turned by angle theta;
    output de-interleaved [real parts | imaginary parts]."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 64, generator=g, dtype=torch.float64)
    theta = torch.rand(5, 32, generator=g, dtype=torch.float64) * 6.0
    out = apply_interleaved_rope(x, theta.cos(), theta.sin())
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(theta), theta)[:, None, :]
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], dim=-1))


def test_rope_makes_scores_depend_on_relative_position_only():
    w = IndexerWeights.random(hidden=32, q_lora_rank=16, n_heads=2, head_dim=128, seed=1, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 32, generator=g, dtype=torch.float64)
    ql = torch.randn(2, 16, generator=g, dtype=torch.float64)
    w.inv_freq = w.inv_freq.double()
    s1 = (indexer_queries(w, ql[:1], torch.tensor([7])) * indexer_keys(w, h[1:], torch.tensor([3]))).sum(-1)
    s2 = (indexer_queries(w, ql[:1], torch.tensor([107])) * indexer_keys(w, h[1:], torch.tensor([103]))).sum(-1)
    s3 = (indexer_queries(w, ql[:1], torch.tensor([107])) * indexer_keys(w, h[1:], torch.tensor([3]))).sum(-1)
    torch.testing.assert_close(s1, s2)
    assert not torch.allclose(s1, s3)


def test_head_weights_fold_both_scales():
    w = IndexerWeights.random(hidden=24, q_lora_rank=8, n_heads=4, head_dim=128, seed=5)
    h = torch.randn(3, 24)
    expected = (h @ w.weights_proj.T) / math.sqrt(4) / math.sqrt(128)
    torch.testing.assert_close(head_weights(w, h), expected)


def test_logits_reference_masks_and_sums_relu():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 8, generator=g)
    k = torch.randn(5, 8, generator=g)
    wts = torch.randn(3, 2, generator=g)
    lg = indexer_logits_reference(q, k, wts, torch.tensor([1, 5, 3]))
    for t in range(3):
        for s in range(5):
            if s >= [1, 5, 3][t]:
                assert lg[t, s] == float("-inf")
            else:
                want = sum(float(wts[t, h]) * max(0.0, float(q[t, h] @ k[s])) for h in range(2))
                assert abs(float(lg[t, s]) - want) < 1e-5


def test_topk_reference_pads_short_rows_and_breaks_ties_low():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.5],
                           [1.0, 9.0, 8.0, 7.0, 6.0, 5.0]])
    out = indexer_topk_reference(logits, 3, torch.tensor([6, 2]))
    assert out.dtype == torch.int32
    assert out[0].tolist() == [0, 2, 3]          # 3.0, then the two lowest of the tied 2.0s
    assert out[1].tolist() == [0, 1, -1]         # the row sees only 2 positions


def test_topk_set_checker_accepts_any_tie_choice_and_rejects_wrong_sets():
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.5])
    assert topk_set_is_valid(torch.tensor([0, 2, 3]), scores, 3, 6)[0]
    assert topk_set_is_valid(torch.tensor([4, 0, 3]), scores, 3, 6)[0]      # another tie choice, any order
    assert not topk_set_is_valid(torch.tensor([0, 2, 1]), scores, 3, 6)[0]  # 1.0 below the k-th score
    assert not topk_set_is_valid(torch.tensor([2, 3, 4]), scores, 3, 6)[0]  # misses the 3.0
    assert not topk_set_is_valid(torch.tensor([0, 2, -1]), scores, 3, 6)[0]  # too few
    assert not topk_set_is_valid(torch.tensor([0, 2, 2]), scores, 3, 6)[0]  # duplicate
    assert topk_set_is_valid(torch.tensor([0, 1, -1]), scores, 3, 2)[0]     # short row: whole context
    fails = topk_sets_agree(torch.tensor([[0, 2, 3], [2, 3, 4]]), scores.repeat(2, 1), 3, torch.tensor([6, 6]))
    assert len(fails) == 1 and fails[0].startswith("row 1")


def test_bad_shapes_raise_one_line_errors():
    w = IndexerWeights.random(hidden=16, q_lora_rank=8, n_heads=2, head_dim=128)
    with pytest.raises(Glm5labError, match="q_latent"):
        indexer_queries(w, torch.randn(3, 9), torch.arange(3))
    with pytest.raises(Glm5labError, match="hidden"):
        indexer_keys(w, torch.randn(3, 15), torch.arange(3))
    with pytest.raises(Glm5labError, match="weights"):
        indexer_logits_reference(torch.randn(2, 2, 8), torch.randn(3, 8), torch.randn(2, 3))
    with pytest.raises(Glm5labError, match="tokens"):
        indexer_reference(w, torch.randn(3, 16), torch.randn(4, 8))


def test_end_to_end_table_shows_selection_matters_and_errors_as_rows():
    """Notebook 05b's table: with the reference top-k the layer output equals transformers', dense causal
    attention does not; a broken selection becomes an error row, not an exception."""
    from glm5lab.model.tiny import build_tiny_model
    from glm5lab.sparse import indexer_demo as demo

    model = build_tiny_model(seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    captured = demo.capture_layers(model, ids)
    first = captured[0]
    T = first["hidden"].shape[0]
    hf = first["hf_topk"]
    ref_top = torch.where(hf <= torch.arange(T)[:, None], hf, torch.full_like(hf, -1))  # causal, -1 padded
    bad_top = torch.full((3, 2), 10**6, dtype=torch.long)          # wrong shape: must not raise
    table = demo.end_to_end_table(model, captured, ref_top, bad_top)
    assert set(table["selection"]) == {"transformers' top-k", "glm5lab reference top-k",
                                       "glm5lab Triton top-k (fp32 cache)", "dense causal (no top-k)"}
    ok = table[table["selection"] == "glm5lab reference top-k"].iloc[0]
    dense = table[table["selection"] == "dense causal (no top-k)"].iloc[0]
    assert float(ok["relative error"]) < 1e-3 < 0.1 < float(dense["relative error"])
    broken = table[table["selection"] == "glm5lab Triton top-k (fp32 cache)"]
    assert "error" in table.columns and broken["error"].notna().all()
