"""Torch reference of GLM-5's DSA "lightning indexer": which KV positions each query token attends to.

Matches transformers' `GlmMoeDsaIndexer` (models/glm_moe_dsa/modeling_glm_moe_dsa.py, transformers 5.x):

  q  = indexer.wq_b(q_latent)                       [T, H=32, D=128]   from the q LoRA latent
  k  = LayerNorm(indexer.wk(hidden))                [T, D]             one key per token (MQA)
  rope on the first `qk_rope_head_dim` (64) dims of q and k, INTERLEAVED pairs (x0,x1),(x2,x3)...
       (DeepSeek-V3.2 rotates halves instead; GLM-5 rotates pairs). transformers writes the rotated
       pairs back de-interleaved ([evens | odds]); q and k get the same permutation, so q.k is unchanged.
  w  = indexer.weights_proj(hidden) * H**-0.5       [T, H]
  logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s] * D**-0.5)           causal: s <= position of t
  top-k (index_topk = 2048 in GLM-5) per token; a context shorter than k gives all of it, -1 padded.

Because D**-0.5 > 0, relu(x * c) = c * relu(x): the kernels (like vLLM) take `weights` with both scales
folded in (`w * D**-0.5`) and compute sum_h weights * relu(q.k). `head_weights()` returns exactly that.

Tie rule (shared by every top-k in glm5lab): a top-k set over a row is any set of min(k, n_valid) valid
positions that contains every position whose score is strictly above the k-th largest score v_k and
fills the rest with positions whose score equals v_k. Which tied positions are chosen is not part of
the contract. glm5lab's own top-k breaks ties by the lowest position and returns positions ascending;
`-0.0` counts as `+0.0`. `topk_set_is_valid()` checks a set against this rule (with a tolerance when the
scores it is checked against were computed with different rounding).
"""
from __future__ import annotations

import dataclasses

import torch

from glm5lab.errors import Glm5labError


@dataclasses.dataclass
class IndexerWeights:
    """The indexer's parameters (one layer) plus the rope frequencies of the model."""

    wq_b: torch.Tensor            # [H*D, q_lora_rank]
    wk: torch.Tensor              # [D, hidden]
    k_norm_weight: torch.Tensor   # [D]
    k_norm_bias: torch.Tensor     # [D]
    weights_proj: torch.Tensor    # [H, hidden]
    inv_freq: torch.Tensor        # [rope_dim // 2]
    n_heads: int
    head_dim: int
    rope_dim: int
    index_topk: int
    rope_attention_scaling: float = 1.0
    k_norm_eps: float = 1e-6

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @classmethod
    def from_hf(cls, indexer, config) -> "IndexerWeights":
        """From a transformers `GlmMoeDsaIndexer` module and the model's config (for the rope)."""
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding

        rotary = GlmMoeDsaRotaryEmbedding(config)
        return cls(wq_b=indexer.wq_b.weight.detach(), wk=indexer.wk.weight.detach(),
                   k_norm_weight=indexer.k_norm.weight.detach(), k_norm_bias=indexer.k_norm.bias.detach(),
                   weights_proj=indexer.weights_proj.weight.detach(),
                   inv_freq=rotary.inv_freq.detach().float(),
                   n_heads=config.index_n_heads, head_dim=config.index_head_dim,
                   rope_dim=config.qk_rope_head_dim, index_topk=config.index_topk,
                   rope_attention_scaling=float(rotary.attention_scaling),
                   k_norm_eps=float(indexer.k_norm.eps))

    @classmethod
    def random(cls, *, hidden: int, q_lora_rank: int, n_heads: int = 32, head_dim: int = 128,
               rope_dim: int = 64, index_topk: int = 2048, rope_theta: float = 10000.0,
               seed: int = 0, dtype: torch.dtype = torch.float32) -> "IndexerWeights":
        """Random weights at any size (benchmarks and kernel tests that do not need the tiny model)."""
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(dtype)

        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        return cls(wq_b=rnd(n_heads * head_dim, q_lora_rank, scale=q_lora_rank ** -0.5),
                   wk=rnd(head_dim, hidden, scale=hidden ** -0.5),
                   k_norm_weight=1 + rnd(head_dim, scale=0.1), k_norm_bias=rnd(head_dim, scale=0.1),
                   weights_proj=rnd(n_heads, hidden, scale=hidden ** -0.5), inv_freq=inv_freq,
                   n_heads=n_heads, head_dim=head_dim, rope_dim=rope_dim, index_topk=index_topk)


def _rope_cos_sin(w: IndexerWeights, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of each rotated pair [T, rope_dim // 2], computed the way transformers does (float32,
    then cast to the activation dtype)."""
    freqs = positions.float()[:, None] * w.inv_freq.to(positions.device)[None, :]
    cos = (freqs.cos() * w.rope_attention_scaling).to(dtype)
    sin = (freqs.sin() * w.rope_attention_scaling).to(dtype)
    return cos, sin


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x0,x1),(x2,x3),... of the last dim; output de-interleaved [rotated evens | odds],
    as transformers' `apply_rotary_pos_emb_interleave` writes it. cos/sin [T, d/2] broadcast over the
    middle dims of x [T, ..., d]."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _check_2d(name: str, t: torch.Tensor, width: int) -> None:
    if t.dim() != 2 or t.shape[1] != width:
        raise Glm5labError(f"{name} must be [tokens, {width}], got shape {tuple(t.shape)}")


def indexer_queries(w: IndexerWeights, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index queries [T, H, D] from the q LoRA latent (q_a_layernorm(q_a_proj(x))), roped."""
    _check_2d("q_latent", q_latent, w.wq_b.shape[1])
    q = torch.nn.functional.linear(q_latent, w.wq_b.to(q_latent.dtype))
    q = q.view(q.shape[0], w.n_heads, w.head_dim)
    cos, sin = _rope_cos_sin(w, positions, q.dtype)
    return torch.cat([apply_interleaved_rope(q[..., :w.rope_dim], cos, sin), q[..., w.rope_dim:]], dim=-1)


def indexer_keys(w: IndexerWeights, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index keys [T, D] (what the index-key cache stores): LayerNorm(wk(hidden)), roped."""
    _check_2d("hidden", hidden, w.wk.shape[1])
    k = torch.nn.functional.linear(hidden, w.wk.to(hidden.dtype))
    k = torch.nn.functional.layer_norm(k, (w.head_dim,), w.k_norm_weight.to(k.dtype),
                                       w.k_norm_bias.to(k.dtype), w.k_norm_eps)
    cos, sin = _rope_cos_sin(w, positions, k.dtype)
    return torch.cat([apply_interleaved_rope(k[:, :w.rope_dim], cos, sin), k[:, w.rope_dim:]], dim=-1)


def head_weights(w: IndexerWeights, hidden: torch.Tensor) -> torch.Tensor:
    """Per-head weights [T, H] float32 with BOTH scales folded in: weights_proj(x) * H**-0.5 * D**-0.5.
    sum_h head_weights * relu(q.k) is then exactly the model's index score."""
    _check_2d("hidden", hidden, w.weights_proj.shape[1])
    proj = torch.nn.functional.linear(hidden, w.weights_proj.to(hidden.dtype)).float()
    return proj * (w.n_heads ** -0.5) * w.softmax_scale


def indexer_logits_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                             lengths: torch.Tensor | None = None,
                             compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """logits[t, s] = sum_h weights[t,h] * relu(q[t,h] . k[s]); -inf where s >= lengths[t].

    q [T, H, D], k [S, D] (one key sequence every row sees), weights [T, H] (scales folded in).
    `lengths[t]` is how many keys row t may see (causal: position + 1); None = all S.
    """
    if q.dim() != 3 or k.dim() != 2 or q.shape[-1] != k.shape[-1]:
        raise Glm5labError(f"q [T,H,D] and k [S,D] expected, got {tuple(q.shape)} and {tuple(k.shape)}")
    if weights.shape != q.shape[:2]:
        raise Glm5labError(f"weights must be [T, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    scores = torch.einsum("thd,sd->ths", q.to(compute_dtype), k.to(compute_dtype)).relu()
    logits = torch.einsum("th,ths->ts", weights.to(compute_dtype), scores)
    if lengths is not None:
        cols = torch.arange(k.shape[0], device=k.device)
        logits = logits.masked_fill(cols[None, :] >= lengths.to(k.device)[:, None], float("-inf"))
    return logits


def indexer_topk_reference(logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k positions per row among columns < lengths[row], ascending, -1 padded: int32 [T, k].
    Ties at the k-th score: lowest positions first (torch.topk on a stable order is not guaranteed, so
    the order is made explicit by a stable sort)."""
    if logits.dim() != 2:
        raise Glm5labError(f"logits must be [rows, columns], got shape {tuple(logits.shape)}")
    rows, cols = logits.shape
    if lengths is None:
        lengths = torch.full((rows,), cols, dtype=torch.int64)
    lengths = lengths.to(logits.device).long().clamp(max=cols)
    col = torch.arange(cols, device=logits.device)
    valid = col[None, :] < lengths[:, None]
    x = torch.where(logits == 0, torch.zeros_like(logits), logits).double()   # -0.0 counts as +0.0
    x = x.masked_fill(~valid, float("-inf"))
    order = torch.sort(x, dim=1, descending=True, stable=True).indices     # ties: lowest position first
    take = min(k, cols)
    chosen = order[:, :take]
    keep = torch.arange(take, device=logits.device)[None, :] < lengths[:, None]
    chosen = torch.where(keep, chosen, torch.full_like(chosen, cols))          # cols sorts after real ones
    chosen = torch.sort(chosen, dim=1).values
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :take] = torch.where(chosen < cols, chosen, torch.full_like(chosen, -1)).int()
    return out


def topk_set_is_valid(indices: torch.Tensor, scores: torch.Tensor, k: int, length: int,
                      atol: float = 0.0) -> tuple[bool, str]:
    """Check ONE row's top-k (int, -1 = none) against the tie rule over `scores[:length]`.

    With atol > 0, scores within atol of the k-th largest count as tied (for sets computed from
    scores rounded differently from the ones checked against). Returns (ok, reason)."""
    idx = indices[indices >= 0].long().cpu()
    s = scores[:length].double().cpu()
    want = min(k, length)
    if idx.numel() != want:
        return False, f"{idx.numel()} indices, expected {want}"
    if idx.numel() and (int(idx.max()) >= length):
        return False, f"index {int(idx.max())} beyond the row length {length}"
    if idx.unique().numel() != idx.numel():
        return False, "duplicate indices"
    if want == length:
        return True, "whole context"
    kth = torch.topk(s, want).values[-1]
    chosen = torch.zeros(length, dtype=torch.bool)
    chosen[idx] = True
    missing = (~chosen) & (s > kth + atol)
    if missing.any():
        j = int(missing.nonzero()[0])
        return False, f"position {j} (score {float(s[j]):.6g}) is above the k-th score {float(kth):.6g} but not chosen"
    wrong = chosen & (s < kth - atol)
    if wrong.any():
        j = int(wrong.nonzero()[0])
        return False, f"position {j} (score {float(s[j]):.6g}) is below the k-th score {float(kth):.6g} but chosen"
    return True, "ok"


def topk_sets_agree(indices: torch.Tensor, scores: torch.Tensor, k: int, lengths: torch.Tensor,
                    atol: float = 0.0) -> list[str]:
    """Every row of `indices` [T, k] checked with `topk_set_is_valid`; returns the failures (empty = all
    rows valid). `scores` [T, >=max(lengths)] are the scores the rule is judged on."""
    failures = []
    for t in range(indices.shape[0]):
        ok, why = topk_set_is_valid(indices[t], scores[t], k, int(lengths[t]), atol)
        if not ok:
            failures.append(f"row {t}: {why}")
    return failures


@dataclasses.dataclass
class IndexerOutput:
    topk: torch.Tensor      # [T, k] int32, request-local positions ascending, -1 padded
    logits: torch.Tensor    # [T, T] float32, -inf above the diagonal
    q: torch.Tensor         # [T, H, D]
    k: torch.Tensor         # [T, D]
    weights: torch.Tensor   # [T, H] (scales folded in)


def indexer_reference(w: IndexerWeights, hidden: torch.Tensor, q_latent: torch.Tensor,
                      positions: torch.Tensor | None = None, topk: int | None = None,
                      compute_dtype: torch.dtype = torch.float32) -> IndexerOutput:
    """The whole indexer step for one sequence prefilled from position 0 (causal).

    hidden [T, hidden] is the layer's normed input (what the attention block sees), q_latent
    [T, q_lora_rank] is q_a_layernorm(q_a_proj(hidden)). Returns the top-k and its intermediates.
    """
    T = hidden.shape[0]
    if q_latent.shape[0] != T:
        raise Glm5labError(f"hidden has {T} tokens but q_latent has {q_latent.shape[0]}")
    if positions is None:
        positions = torch.arange(T, device=hidden.device)
    q = indexer_queries(w, q_latent, positions)
    k = indexer_keys(w, hidden, positions)
    weights = head_weights(w, hidden)
    lengths = positions.long() + 1
    logits = indexer_logits_reference(q, k, weights, lengths, compute_dtype)
    top = indexer_topk_reference(logits, topk or w.index_topk, lengths)
    return IndexerOutput(topk=top, logits=logits, q=q, k=k, weights=weights)
