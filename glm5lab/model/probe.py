"""Look inside a transformers GLM-5 forward pass: the DSA indexer's scores (before top-k) and the
attention probabilities, per layer. Used to show that the tiny model's top-k is decided by clear margins,
not by tie-breaking, and as the reference the sparse kernels are compared against."""
from __future__ import annotations


def _index_scores(indexer, hidden_states, q_resid, position_embeddings, attention_mask):
    """Re-run GlmMoeDsaIndexer.forward up to (and including) the causal mask, without the top-k."""
    import torch
    import torch.nn.functional as F
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * indexer.n_heads ** -0.5
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return index_scores.masked_fill(~attention_mask, float("-inf"))
    return index_scores + attention_mask


def indexer_scores(model, input_ids) -> list:
    """Per layer (None for layers that reuse a previous top-k): index scores [batch, query, key] with
    -inf at masked (future) keys; `scores.topk(index_topk)` reproduces the model's selection."""
    import torch

    layers = model.model.layers
    captured: dict[int, object] = {}
    hooks = []
    for i, layer in enumerate(layers):
        idx = layer.self_attn.indexer
        if idx is None:
            continue

        def hook(module, args, kwargs, output, i=i):
            names = ["hidden_states", "q_resid", "position_embeddings", "attention_mask"]
            vals = list(args) + [kwargs[n] for n in names[len(args):]]
            captured[i] = _index_scores(module, *vals[:4])

        hooks.append(idx.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [captured.get(i) for i in range(len(layers))]


def attention_probs(model, input_ids) -> list:
    """Per layer: softmax probabilities [batch, heads, query, key] of the (sparse-masked) attention,
    from the eager implementation."""
    import torch

    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids, output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
    return list(out.attentions)
