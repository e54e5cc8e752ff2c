"""The DSA indexer on the tiny GLM-5, end to end, as notebook 05b shows it: transformers' own indexer vs
glm5lab's reference and kernels, and the top-k feeding sparse MLA attention for one layer.

Every function returns data (dicts, DataFrames, paths); nothing here raises for a failed comparison, so a
notebook can show a mismatch instead of dying on it.
"""
from __future__ import annotations

import torch

from glm5lab.files import save_figure
from glm5lab.sparse.indexer_reference import (IndexerWeights, apply_interleaved_rope, indexer_reference,
                                              topk_sets_agree, topk_set_is_valid, _rope_cos_sin)


def _kernel_device() -> str:
    """Where Triton kernels can run: the GPU, else the CPU under TRITON_INTERPRET=1."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def capture_layers(model, input_ids: torch.Tensor) -> list[dict]:
    """Run the model once and record, per layer with an indexer: the attention block's input (normed
    hidden states), the q LoRA latent, transformers' top-k, and the attention block's output."""
    calls: dict[int, dict] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def attn_hook(module, args, kwargs, output, i=i):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            calls.setdefault(i, {})["hidden"] = hidden.detach()[0]
            calls[i]["attn_out"] = output[0].detach()[0]

        handles.append(attn.register_forward_hook(attn_hook, with_kwargs=True))
        if attn.indexer is not None:
            def idx_hook(module, args, kwargs, output, i=i):
                calls.setdefault(i, {})["q_resid"] = args[1].detach()[0]
                calls[i]["hf_topk"] = output.detach()[0]
                calls[i]["indexer"] = module

            handles.append(attn.indexer.register_forward_hook(idx_hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return [dict(layer=i, **calls[i]) for i in sorted(calls) if "indexer" in calls[i]]


def compare_reference_with_transformers(model, captured: list[dict]) -> list[dict]:
    """Per layer: rows where glm5lab's reference top-k set equals transformers' (positions <= t)."""
    config = model.config
    rows = []
    for c in captured:
        w = IndexerWeights.from_hf(c["indexer"], config)
        out = indexer_reference(w, c["hidden"], c["q_resid"])
        T = c["hidden"].shape[0]
        same = sum({i for i in out.topk[t].tolist() if i >= 0} == {i for i in c["hf_topk"][t].tolist() if i <= t}
                   for t in range(T))
        selected = (out.topk >= 0).sum(1)
        rows.append({"layer": c["layer"], "tokens": T, "index_topk": config.index_topk,
                     "rows identical to transformers": same,
                     "rows with a strict subset": int((selected < torch.arange(1, T + 1)).sum()),
                     "last row: selected / context": f"{int(selected[-1])} / {T}"})
    return rows


CACHE_DTYPES = {"fp8": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kernel_topk_paged(w: IndexerWeights, hidden: torch.Tensor, q_latent: torch.Tensor, *,
                      cache: str = "fp8", page: int = 16, seed: int = 0) -> dict:
    """glm5lab's Triton indexer on the tiny model: write the index keys of one sequence into a paged cache
    (`cache` "fp8" = vLLM's layout with bf16 queries, or "bf16"/"fp16"/"fp32" keys and queries) through a
    shuffled block table, then score every token as a decode row that sees positions 0..t, and take the
    top-k. Returns the top-k, the block table, the reference, and the tie-rule check against the reference
    logits (a near-tie counts as a tie within the tolerance of the cache's rounding)."""
    from glm5lab.kernels.dsa_indexer import indexer_logits_decode, indexer_topk, write_index_key_cache

    dtype = CACHE_DTYPES[cache]
    ref = indexer_reference(w, hidden, q_latent)
    T, D = ref.k.shape
    pages = -(-T // page)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = pages + 3                                           # a few blocks other requests own
    block_row = torch.randperm(num_blocks, generator=gen)[:pages].int()
    dev = _kernel_device()
    kv = (torch.zeros(num_blocks, page, D + 4, dtype=torch.uint8, device=dev) if cache == "fp8"
          else torch.zeros(num_blocks, page, D, dtype=dtype, device=dev))
    pos = torch.arange(T)
    write_index_key_cache(kv, ref.k.to(dtype).to(dev), (block_row[pos // page].long() * page + pos % page).to(dev))
    lengths = (pos + 1).int()
    bt = block_row[None, :].expand(T, pages).contiguous()
    logits = indexer_logits_decode(ref.q.to(dtype).contiguous().to(dev), ref.weights.to(dev), kv, bt.to(dev),
                                   lengths.to(dev))
    top = indexer_topk(logits, w.index_topk, lengths.to(dev)).cpu()
    logits = logits.cpu()
    scale = float(ref.logits[torch.isfinite(ref.logits)].abs().max())
    tol = {"fp8": 0.03, "bf16": 4e-3, "fp16": 5e-4, "fp32": 1e-5}[cache] * scale
    failures = topk_sets_agree(top, ref.logits, w.index_topk, lengths, atol=tol)
    same = sum(set(top[t][top[t] >= 0].tolist()) == set(ref.topk[t][ref.topk[t] >= 0].tolist()) for t in range(T))
    return {"topk": top, "reference_topk": ref.topk, "block_table": block_row, "logits": logits,
            "reference_logits": ref.logits, "rows_identical": same, "rows": T, "tie_rule_failures": failures,
            "tolerance": tol, "cache": cache}


def layer_attention(model, captured: dict, topk: torch.Tensor | None, attention: str = "reference") -> dict:
    """One layer's attention output computed the serving way (latent cache rows, absorbed query, sparse MLA
    over the slots the top-k names) vs transformers' output for that layer.

    topk [T, k] request-local positions (-1 padded) or None for dense causal attention. attention:
    "reference" (glm5lab.sparse.reference.sparse_mla_reference, float64) or "kernel"
    (glm5lab.kernels.sparse_mla.sparse_mla_attention, bf16). Returns errors relative to transformers."""
    from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference

    config = model.config
    attn = model.model.layers[captured["layer"]].self_attn
    x, q_resid = captured["hidden"], captured["q_resid"]
    T, H = x.shape[0], config.num_attention_heads
    nope, rope, rank, vdim = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank,
                              config.v_head_dim)
    w = IndexerWeights.from_hf(captured["indexer"], config)
    pos = torch.arange(T)
    cos, sin = _rope_cos_sin(w, pos, torch.float32)
    with torch.no_grad():
        q = attn.q_b_proj(q_resid).view(T, H, nope + rope)
        ckv = attn.kv_a_proj_with_mqa(x)
        c_kv = attn.kv_a_layernorm(ckv[:, :rank])
        k_rot = apply_interleaved_rope(ckv[:, None, rank:], cos, sin)[:, 0]
        q_rot = apply_interleaved_rope(q[..., nope:], cos, sin)
        kv_b = attn.kv_b_proj.weight.view(H, nope + vdim, rank)
        q_full = torch.cat([torch.einsum("thn,hnr->thr", q[..., :nope], kv_b[:, :nope]), q_rot], dim=-1)
        kv_rows = torch.cat([c_kv, k_rot], dim=-1)                       # [T, 576]: slot = position here
        if topk is None:
            j = torch.arange(T)
            slots = torch.where(j[None, :] <= pos[:, None], j[None, :], torch.full_like(j, -1)[None, :])
        else:
            slots = topk.long()
        scale = mla_softmax_scale(nope, rope)
        if attention == "kernel":
            from glm5lab.kernels.sparse_mla import sparse_mla_attention

            dev = _kernel_device()
            kv = kv_rows.to(torch.bfloat16).view(T, 1, rank + rope).to(dev)
            latent, _ = sparse_mla_attention(q_full.to(torch.bfloat16).to(dev), kv, slots.to(torch.int32).to(dev),
                                             scale)
            latent = latent.float().cpu()
        else:
            latent, _ = sparse_mla_reference(q_full, kv_rows, slots, scale)
        v = torch.einsum("thr,hvr->thv", latent.float(), kv_b[:, nope:])
        out = attn.o_proj(v.reshape(T, -1))
    ref = captured["attn_out"]
    err = (out - ref).abs().max()
    return {"attention": attention, "slots": "all causal" if topk is None else f"top-{slots.shape[1]}",
            "max |out - transformers|": float(err),
            "relative error": float((out - ref).norm() / ref.norm()),
            "transformers output max": float(ref.abs().max())}


def selection_figure(topk: torch.Tensor, path, title: str):
    """Picture of which earlier positions every token attends to (rows: query token, columns: position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = topk.shape[0]
    mask = torch.zeros(T, T)
    for t in range(T):
        idx = topk[t][topk[t] >= 0].long()
        mask[t, idx] = 1.0
    causal = torch.tril(torch.ones(T, T))
    img = causal * 0.25 + mask * 0.75
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.imshow(img, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query token")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return fig


__all__ = ["capture_layers", "compare_reference_with_transformers", "kernel_topk_paged", "layer_attention",
           "selection_figure", "topk_set_is_valid"]


def end_to_end_table(model, captured: list[dict], reference_topk: torch.Tensor, kernel_topk: torch.Tensor):
    """Layer 0's attention output against transformers' for each source of the top-k (transformers', the glm5lab
    reference, the glm5lab Triton kernels, none = dense causal), with the reference attention and, for the
    Triton top-k, glm5lab's fused kernel too. A failure becomes an `error` row, never an exception."""
    import pandas as pd

    first = captured[0]
    T = first["hidden"].shape[0]
    hf_top = first["hf_topk"]
    hf_top = torch.where(hf_top <= torch.arange(T)[:, None], hf_top, torch.full_like(hf_top, -1))
    selections = {"transformers' top-k": hf_top, "glm5lab reference top-k": reference_topk,
                  "glm5lab Triton top-k (fp32 cache)": kernel_topk, "dense causal (no top-k)": None}
    rows = []
    for name, top in selections.items():
        # the fused kernel runs in the interpreter on CPU: one run (on the Triton top-k) is enough to show it
        impls = ["reference", "kernel"] if name == "glm5lab Triton top-k (fp32 cache)" else ["reference"]
        for impl in impls:
            try:
                r = layer_attention(model, first, top, impl)
            except Exception as exc:   # shown as data in the notebook, never raised
                r = {"attention": impl, "error": f"{type(exc).__name__}: {exc}"}
            rows.append({"selection": name, **r})
    return pd.DataFrame(rows)
