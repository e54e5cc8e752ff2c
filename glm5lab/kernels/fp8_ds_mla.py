"""vLLM's `fp8_ds_mla` KV-cache layout (DeepSeek-V3.2 "FP8 with scale"), in plain torch.

One cache slot is 656 bytes (uint8), in this order (vLLM 0.32 `flashmla_sparse.py` layout note and
FlashMLA's `flash_mla_interface.py` docstring agree):
  bytes [0, 512)    512 float8_e4m3fn values: the latent c_kv ("NoPE"), quantized
  bytes [512, 528)  4 float32 scales, one per 128 latent values (value = fp8 * scale)
  bytes [528, 656)  64 bfloat16 values: the roped key k_pe, not quantized
Dequantization only needs the stored scales, so kernels are agnostic to how a writer chose them; this
quantizer uses amax / 448 per 128-value tile (448 = largest finite e4m3 value), floor 1e-4 so all-zero
tiles do not divide by zero -- the same rule as vLLM's `concat_and_cache_ds_mla` writer.

Kernel tests compare against the DEQUANTIZED cache, so quantization error never hides in a tolerance.
"""
from __future__ import annotations

import torch

from glm5lab.errors import Glm5labError

LATENT = 512
ROPE = 64
TILE = 128
NUM_TILES = LATENT // TILE                     # 4
SCALE_OFFSET = LATENT                          # 512
ROPE_OFFSET = LATENT + 4 * NUM_TILES           # 528
ROW_BYTES = ROPE_OFFSET + 2 * ROPE             # 656
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4


def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """[..., 576] float tensor -> [..., 656] uint8 in the fp8_ds_mla layout."""
    if kv.dim() == 0 or kv.shape[-1] != LATENT + ROPE:
        raise Glm5labError(f"fp8_ds_mla needs rows of {LATENT + ROPE} values (512 latent + 64 rope), "
                           f"got shape {tuple(kv.shape)}")
    if not kv.dtype.is_floating_point:
        raise Glm5labError(f"fp8_ds_mla quantizes floating-point rows, got {kv.dtype}")
    lead = kv.shape[:-1]
    x = kv.reshape(-1, LATENT + ROPE)
    nope = x[:, :LATENT].float().reshape(-1, NUM_TILES, TILE)
    scale = nope.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX          # [N, 4] float32
    q8 = (nope / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(x.shape[0], ROW_BYTES, dtype=torch.uint8, device=kv.device)
    out[:, :LATENT] = q8.reshape(-1, LATENT).view(torch.uint8)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    out[:, ROPE_OFFSET:] = x[:, LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.reshape(*lead, ROW_BYTES)


def dequantize_fp8_ds_mla(cache: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., 656] uint8 -> [..., 576] in `dtype` (default float32, which holds every dequantized value
    exactly up to the one rounding of fp8 * scale)."""
    if cache.dtype != torch.uint8 or cache.dim() == 0 or cache.shape[-1] != ROW_BYTES:
        raise Glm5labError(f"fp8_ds_mla cache must be uint8 [..., {ROW_BYTES}], "
                           f"got {cache.dtype} {tuple(cache.shape)}")
    if not dtype.is_floating_point:
        raise Glm5labError(f"fp8_ds_mla dequantizes to a floating-point dtype, got {dtype}")
    lead = cache.shape[:-1]
    c = cache.reshape(-1, ROW_BYTES)
    q8 = c[:, :LATENT].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, NUM_TILES, TILE)
    scale = c[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)         # [N, 4]
    nope = (q8 * scale[..., None]).reshape(-1, LATENT)
    rope = c[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype).reshape(*lead, LATENT + ROPE)
