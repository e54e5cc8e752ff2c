"""Torch reference for sparse MLA attention in the absorbed (MQA) form used at decode.

After weight absorption every query head attends over the same latent KV rows:
  q      [tokens, heads, kv_lora_rank + rope]      (GLM-5: 512 + 64 = 576)
  kv     one row of 576 per cache slot: latent c_kv (512) followed by the roped key k_pe (64)
  out    [tokens, heads, kv_lora_rank]               attention-weighted sum of the latent part only
  score  q . kv_row * softmax_scale

The scale is the model's own 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (GLM-5: 1/sqrt(192 + 64)), not
1/sqrt(576): absorption rewrites q_nope . (W_uk c_kv) as (W_uk^T q_nope) . c_kv, which is the same number,
so the softmax must see the same scale the model was trained with; 576 is only the width of the rewritten
dot product.

Empty rows (a token with no valid slot) give out = 0 and lse = -inf, never NaN. lse is natural-log.
"""
from __future__ import annotations

import math

import torch

from glm5lab.errors import Glm5labError

GLM5_KV_LORA_RANK = 512
GLM5_ROPE_DIM = 64
GLM5_QK_NOPE_DIM = 192


def mla_softmax_scale(qk_nope_head_dim: int = GLM5_QK_NOPE_DIM, qk_rope_head_dim: int = GLM5_ROPE_DIM,
                      mscale: float = 1.0) -> float:
    """Softmax scale of the original (non-absorbed) attention; `mscale` is YaRN's extra factor, squared
    into the scale the way DeepSeek-style models apply it (1.0 when the model uses no rope scaling)."""
    return mscale * mscale / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)


def flatten_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, D] (vLLM's paged layout) or [slots, D] -> [slots, D] view."""
    if kv_cache.dim() == 3:
        return kv_cache.reshape(-1, kv_cache.shape[-1])
    if kv_cache.dim() == 2:
        return kv_cache
    raise Glm5labError(f"kv_cache must be [blocks, block_size, D] or [slots, D], got shape {tuple(kv_cache.shape)}")


def sparse_mla_reference(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                         softmax_scale: float, kv_lora_rank: int = GLM5_KV_LORA_RANK,
                         compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each token over its own KV slots (global cache indices, -1 = skip, any position).

    q [T, H, D]; kv_cache [blocks, block_size, D] or [slots, D] (already dequantized); slots [T, K] int.
    Returns (out [T, H, kv_lora_rank], lse [T, H]) in `compute_dtype`. Duplicate slots count twice,
    exactly as a kernel that reads each listed slot would. A slot beyond the cache is an error here, where the
    kernels skip it as they skip -1: the reference is strict so that a test's own indexing slip shows up
    (the kernel tests that list such slots give the reference -1 in their place).
    """
    if q.dim() != 3:
        raise Glm5labError(f"q must be [tokens, heads, D], got shape {tuple(q.shape)}")
    kv = flatten_kv_cache(kv_cache)
    if kv.shape[-1] != q.shape[-1]:
        raise Glm5labError(f"q width {q.shape[-1]} != kv row width {kv.shape[-1]}")
    if not 0 < kv_lora_rank <= q.shape[-1]:
        raise Glm5labError(f"kv_lora_rank {kv_lora_rank} out of range for width {q.shape[-1]}")
    if slots.dim() != 2 or slots.shape[0] != q.shape[0]:
        raise Glm5labError(f"slots must be [tokens={q.shape[0]}, topk], got shape {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise Glm5labError(f"slots must be int32 or int64, got {slots.dtype}")
    num_slots = kv.shape[0]
    slots = slots.long()
    if bool((slots >= num_slots).any()):
        raise Glm5labError(f"slot index {int(slots.max())} is beyond the cache ({num_slots} slots)")
    valid = slots >= 0                                            # [T, K]
    rows = kv.to(compute_dtype)[slots.clamp(min=0)]               # [T, K, D]
    scores = torch.einsum("thd,tkd->thk", q.to(compute_dtype), rows) * softmax_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                          # [T, H]; -inf for empty rows
    probs = torch.exp(scores - lse.clamp(min=torch.finfo(compute_dtype).min)[..., None])
    probs = torch.where(valid[:, None, :], probs, torch.zeros((), dtype=compute_dtype))
    out = torch.einsum("thk,tkd->thd", probs, rows[..., :kv_lora_rank])
    return out, lse


def dense_mla_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, softmax_scale: float,
                        kv_lora_rank: int = GLM5_KV_LORA_RANK,
                        compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged dense decode attention: query row b attends to tokens 0..seq_lens[b]-1 of its block table
    row (token j lives at slot block_table[b, j // block_size] * block_size + j % block_size)."""
    if kv_cache.dim() != 3:
        raise Glm5labError("dense_mla_reference needs the paged layout [blocks, block_size, D]")
    block_size = kv_cache.shape[1]
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    if max_len > block_table.shape[1] * block_size:
        raise Glm5labError(f"a seq_len of {max_len} needs {-(-max_len // block_size)} blocks but the block "
                           f"table has {block_table.shape[1]} columns")
    j = torch.arange(max_len, device=q.device)
    slots = block_table.long()[:, j // block_size] * block_size + j % block_size
    slots = torch.where(j[None, :] < seq_lens.long()[:, None], slots, torch.full_like(slots, -1))
    return sparse_mla_reference(q, kv_cache, slots, softmax_scale, kv_lora_rank, compute_dtype)
