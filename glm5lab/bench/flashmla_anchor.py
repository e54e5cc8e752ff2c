"""FlashMLA's compiled sparse kernels as the speed anchor, loaded without vLLM.

`../shared/tools/get-flashmla-anchor .anchor` extracts `_flashmla_C.abi3.so` (from the vllm 0.24.0 wheel,
which links the same torch 2.11 / CUDA 13 as the H200 image) and the Python interface it was built with
(`flash_mla_interface.reference.py.txt`). The argument orders below are read from that file:

  sparse_decode_fwd(q [b, s_q, h_q, 576] bf16, k_cache [blocks, page, 1, 656] uint8 (fp8_ds_mla),
                    indices [b, s_q, topk] int32, topk_length, attn_sink, tile_scheduler_metadata,
                    num_splits, extra_k_cache, extra_indices, extra_topk_length, head_dim_v, softmax_scale,
                    out) -> (out, lse [b, h_q, s_q], new_tile_scheduler_metadata, new_num_splits)
      h_q must be 64 or 128: vLLM pads fewer heads with zeros, and so do we (the padding is part of the
      cost FlashMLA pays for 8 heads a GPU).
  sparse_prefill_fwd(q [s_q, h_q, 576] bf16, kv [s_kv, 1, 576] bf16, indices [s_q, 1, topk] int32,
                     sm_scale, d_v, attn_sink, topk_length, out) -> (out, max_logits, lse)
      h_q a multiple of 64 on Hopper (vLLM pads).

Nothing here is imported by the kernels or the vLLM backend: it exists for the benchmark and its tests.
"""
from __future__ import annotations

import os
from pathlib import Path

from glm5lab.errors import Glm5labError

_LOADED: dict = {}


def anchor_dir() -> Path:
    """GLM5LAB_FLASHMLA_DIR, else `.anchor/` in the working directory or the repository root."""
    env = os.environ.get("GLM5LAB_FLASHMLA_DIR")
    if env:
        return Path(env)
    here = Path.cwd() / ".anchor"
    if here.exists():
        return here
    return Path(__file__).resolve().parents[2] / ".anchor"


def load() -> object:
    """torch.ops._flashmla_C, loading the library once. Raises Glm5labError if it is absent or will not load
    (wrong CUDA/torch ABI, no GPU)."""
    import torch

    if "ops" in _LOADED:
        return _LOADED["ops"]
    lib = anchor_dir() / "_flashmla_C.abi3.so"
    if not lib.exists():
        raise Glm5labError(f"FlashMLA anchor not found at {lib}: run ../shared/tools/get-flashmla-anchor .anchor")
    if not torch.cuda.is_available():
        raise Glm5labError("the FlashMLA anchor needs a CUDA GPU (SM90/SM100)")
    try:
        torch.ops.load_library(str(lib))
        ops = torch.ops._flashmla_C
        ops.sparse_decode_fwd  # noqa: B018  (resolves the op or raises)
    except Exception as exc:  # noqa: BLE001  (any loader failure is reported as one line)
        raise Glm5labError(f"could not load FlashMLA anchor {lib}: {type(exc).__name__}: {exc}") from None
    _LOADED["ops"] = ops
    return ops


def pad_heads(q, heads: int):
    """q [T, H, D] -> [T, heads, D] with zero heads appended (what vLLM does before FlashMLA)."""
    import torch

    if q.shape[1] == heads:
        return q
    qp = torch.zeros(q.shape[0], heads, q.shape[2], dtype=q.dtype, device=q.device)
    qp[:, : q.shape[1]] = q
    return qp


class SparseDecodeFP8:
    """FlashMLA's fp8_ds_mla sparse decode for T tokens, each its own batch entry (s_q = 1), heads padded
    to 64 (or 128). Call returns (out [T, H, 512], lse [T, H]) sliced back to the real heads; the scheduler
    metadata from the first call is reused like vLLM does."""

    def __init__(self, q, cache_u8, slots, softmax_scale: float):
        self.ops = load()
        self.h = q.shape[1]
        padded = 64 if self.h <= 64 else 128
        self.q = pad_heads(q, padded).unsqueeze(1).contiguous()            # [T, 1, Hp, 576]
        self.k = cache_u8.reshape(-1, cache_u8.shape[-2], 1, cache_u8.shape[-1])
        self.idx = slots.to(self.q.device).int().unsqueeze(1).contiguous()   # [T, 1, topk]
        self.scale = float(softmax_scale)
        self.meta = None
        self.splits = None

    def __call__(self):
        out, lse, meta, splits = self.ops.sparse_decode_fwd(
            self.q, self.k, self.idx, None, None, self.meta, self.splits, None, None, None, 512,
            self.scale, None)
        self.meta, self.splits = meta, splits
        return out[:, 0, : self.h], lse[:, : self.h, 0]


class SparsePrefillBF16:
    """FlashMLA's bf16 sparse prefill kernel over a flat [slots, 1, 576] cache, heads padded to 64."""

    def __init__(self, q, kv_bf16, slots, softmax_scale: float):
        self.ops = load()
        self.h = q.shape[1]
        padded = -(-self.h // 64) * 64
        self.q = pad_heads(q, padded).contiguous()
        self.kv = kv_bf16.reshape(-1, 1, kv_bf16.shape[-1])
        self.idx = slots.int().unsqueeze(1).contiguous()
        self.scale = float(softmax_scale)

    def __call__(self):
        out, _max_logits, lse = self.ops.sparse_prefill_fwd(self.q, self.kv, self.idx, self.scale, 512,
                                                            None, None, None)
        return out[:, : self.h], lse[:, : self.h]
