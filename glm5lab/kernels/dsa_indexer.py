"""Triton kernels for GLM-5's DSA lightning indexer: index logits (paged decode, prefill) and top-k.

vLLM computes these with DeepGEMM's fp8 MQA-logits kernels, which exist for SM90 / SM100 / SM120 only; these run on
any GPU Triton supports (SM80-SM89 included) and on the CPU under TRITON_INTERPRET=1.

  logits[t, j] = sum_h weights[t, h] * relu(q[t, h, :] . key_j)         (scales folded into weights,
                                                                          see glm5lab.sparse.indexer_reference)
Index-key caches (one 128-wide key per token, no heads):
  * plain:  [num_blocks, block_size, D] float16/bfloat16/float32
  * fp8:    vLLM's DeepGEMM layout, uint8 [num_blocks, block_size, D + 4]: inside each block, first
            block_size*D float8_e4m3 values (token-major), then block_size float32 scales (one per token,
            power of two: 2**ceil(log2(amax / 448)) — "ue8m0"). `write_index_key_cache` writes it.

Top-k (`indexer_topk`): per row, an exact radix select of the k-th largest score (8 passes of 4 bits over
the order-preserving integer key of each float32), then one pass that writes the chosen positions in
ascending order; ties at the k-th score are broken by the lowest position; -0.0 counts as +0.0; rows
shorter than k give all their positions then -1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5lab.env import interpreter_mode
from glm5lab.errors import Glm5labError
from glm5lab.kernels.checks import at_least_one, index_vector, power_of_two, require_launch_device
from glm5lab.kernels.f16_domain import e4m3_bits_to_f16_times_2e_8, pow2_into_f16_range
from glm5lab.kernels.host import cdiv, cuda_capability, next_pow2

FP8_MAX = 448.0
_KEY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------- helpers
def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs use an exact (IEEE) dot. Triton 3.6's interpreter computes bf16 tl.dot wrongly
    (garbage of order 1e10), so under TRITON_INTERPRET=1 bf16 operands are upcast first."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreter_mode())


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, next_pow2(int(n)))


def is_fp8_cache(cache: torch.Tensor, head_dim: int) -> bool:
    return cache.dtype == torch.uint8 and cache.dim() == 3 and cache.shape[-1] == head_dim + 4


def quantize_keys_fp8(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 e4m3 quantization with a power-of-two scale, as vLLM's indexer cache stores it.
    Returns (values float8_e4m3fn [T, D], scales float32 [T])."""
    kf = k.float()
    amax = kf.abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    values = (kf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def fp8_cache_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values uint8 [blocks, block_size, D], scales float32 [blocks, block_size]) views of a vLLM fp8
    index-key cache; no copies."""
    blocks, bs, width = cache.shape
    if width != head_dim + 4 or cache.dtype != torch.uint8:
        raise Glm5labError(f"fp8 index-key cache must be uint8 [blocks, block_size, {head_dim + 4}], "
                           f"got {cache.dtype} {tuple(cache.shape)}")
    # vLLM hands each layer a view into one shared allocation: blocks may be strided apart, but a block's
    # bytes are contiguous, so these are views (writes through them land in the cache)
    flat = cache.flatten(1)
    if flat.data_ptr() != cache.data_ptr() or flat.stride(1) != 1:
        raise Glm5labError("fp8 index-key cache blocks must be contiguous inside (got a layout that needs a copy)")
    values = flat[:, :bs * head_dim].view(blocks, bs, head_dim)
    scales = flat[:, bs * head_dim:].view(torch.float32)
    return values, scales


def write_index_key_cache(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store keys k [T, D] at global slots (block * block_size + offset; -1 = skip) of a plain or fp8
    (vLLM layout) index-key cache, in place."""
    if k.dim() != 2:
        raise Glm5labError(f"keys must be [tokens, D], got shape {tuple(k.shape)}")
    if cache.dim() != 3:
        raise Glm5labError(f"index-key cache must be [blocks, block_size, width], got shape {tuple(cache.shape)}")
    slot_mapping = index_vector("slot_mapping", slot_mapping, k.shape[0])
    D = k.shape[1]
    blocks, bs = cache.shape[0], cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k = k[keep]
    if slots.numel() and int(slots.max()) >= blocks * bs:
        raise Glm5labError(f"slot {int(slots.max())} beyond the cache ({blocks * bs} slots)")
    blk, off = slots // bs, slots % bs
    if is_fp8_cache(cache, D):
        values, scales = fp8_cache_views(cache, D)
        v, s = quantize_keys_fp8(k)
        values[blk, off] = v.view(torch.uint8)
        scales[blk, off] = s
    elif cache.dim() == 3 and cache.shape[-1] == D and cache.dtype in _KEY_DTYPES:
        cache[blk, off] = k.to(cache.dtype)
    else:
        raise Glm5labError(f"index-key cache must be [blocks, block_size, {D}] fp16/bf16/fp32 or uint8 "
                           f"[blocks, block_size, {D + 4}] (fp8), got {cache.dtype} {tuple(cache.shape)}")


def dequantize_fp8_keys(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 keys (or their uint8 bytes) [..., D] times their float32 scale [...] -> float32 [..., D]."""
    return values.view(torch.float8_e4m3fn).float() * scales[..., None]


def dequantize_index_key_cache(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The cache as float32 [blocks, block_size, D] (for references and tests)."""
    if is_fp8_cache(cache, head_dim):
        return dequantize_fp8_keys(*fp8_cache_views(cache, head_dim))
    return cache.float()


# ----------------------------------------------------------------------------------------------- logits
@triton.jit
def _fragment_order(x, ROWS: tl.constexpr, DP: tl.constexpr):
    """x [ROWS, DP] with its last dimension permuted (the dot's sum over it does not change): column 16j + 8h + 2t + e
    takes x[:, (DP / 4) t + 4j + 2h + e]. An MMA fragment's thread t (of four a row) holds columns 16j + {2t, 2t + 1,
    2t + 8, 2t + 9}: after the permutation those are one contiguous quarter of the row, so keys loaded as 16-byte
    vectors reach their fragments by 16-byte shared-memory reads rather than 2-byte ones (sm_90 build, fp8 keys,
    keys . q^T, 128 keys: 64 LDS.U16 a thread -> 8 LDS.128, NOTES.md v57)."""
    return tl.reshape(tl.permute(tl.reshape(x, [ROWS, 4, DP // 16, 2, 2]), [0, 2, 3, 1, 4]), [ROWS, DP])


@triton.jit
def _fp8_keys(bits, scale, q, SOFT_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """e4m3 key bytes -> the dot's operand for this q, and their per-key scale (both logits kernels)."""
    if SOFT_FP8:   # no e4m3 in hardware (before SM89): the bits moved into fp16 are the keys times 2^-8
        k = e4m3_bits_to_f16_times_2e_8(bits).to(q.dtype)
        scale = scale * 256.0
    elif FP8_DOT:  # q is e4m3 too: the tensor cores take both as they are (sm_90: QGMMA), nothing converted
        k = bits.to(tl.float8e4nv, bitcast=True)
    else:
        k = bits.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    return k, scale


@triton.jit
def _scores_dot(q, k, IEEE: tl.constexpr, KEYS_AS_M: tl.constexpr):
    """q [R, DP] . k [N, DP]^T -> [R, N] fp32, or with KEYS_AS_M k . q^T -> [N, R] (the keys as the MMA's M; both
    logits kernels); IEEE: an fp32 q, summed in fp32 (no TF32)."""
    if KEYS_AS_M:
        a, b = k, q
    else:
        a, b = q, k
    if IEEE:
        s = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(a, tl.trans(b))
    return s


@triton.jit
def _weighted_relu_scores(q, k, w, scale, IEEE: tl.constexpr, KEYS_AS_M: tl.constexpr):
    """q [HP, DP], k [N, DP], w [HP] fp32, scale [N] fp32 (> 0) -> [N] = sum_h w_h relu(q_h.k_n * scale_n), the scale
    applied once a key after the sum (relu commutes with a positive factor). KEYS_AS_M takes the dot as k . q^T, the
    keys as the MMA's M dimension: on Hopper a wgmma (M = 64 a warpgroup) with the converted keys in registers and q
    in shared memory, where q . k^T at HP = 16-32 rows is an mma.sync whose q fragments are copied into place anew
    for every key tile (sm_90 build, fp8 keys, 128 keys: 1,000 -> 768 instructions, NOTES.md v56)."""
    s = _scores_dot(q, k, IEEE, KEYS_AS_M)
    if KEYS_AS_M:     # (no early return: Triton builds the code after one too)
        logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
    else:
        logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    return logit * scale


@triton.jit
def _decode_logits_kernel(Q, W, K, KSCALE, BT, SEQ, OUT,
                          stride_qt, stride_qh, stride_wt, stride_kb, stride_ko, stride_sb,
                          stride_bt, stride_ot, out_cols,
                          H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
                          FP8: tl.constexpr, IEEE: tl.constexpr, SOFT_FP8: tl.constexpr, F16: tl.constexpr,
                          KEYS_AS_M: tl.constexpr, PERMUTE_D: tl.constexpr, FP8_DOT: tl.constexpr):
    """TILES tiles of BLOCK_N keys a program, one after another (the loads of the next in flight while one computes,
    STAGES deep), with the query and weights loaded once. F16 (fp8 keys, fp16/bf16 q): the dot runs in fp16 -- q
    scaled per head by a power of two into fp16's range, the inverse folded into the head's weight (relu commutes
    with a positive factor) -- so the keys take the one-instruction e4m3 -> fp16 conversion."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, DP)
    seq = tl.load(SEQ + t)
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h[:, None] < H) & (offs_d[None, :] < D), other=0.0)
    w = tl.load(W + t * stride_wt + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
    if F16:
        q32 = q.to(tl.float32)
        q_mul = pow2_into_f16_range(tl.max(tl.abs(q32), axis=1))
        q = (q32 * q_mul[:, None]).to(tl.float16)
        w = w / q_mul                       # exact: a power of two
    if PERMUTE_D:
        q = _fragment_order(q, HP, DP)
    for i in tl.range(0, TILES, num_stages=STAGES):
        offs_n = (tl.program_id(1) * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = offs_n < seq
        page = offs_n // PAGE
        within = offs_n % PAGE
        blk = tl.load(BT + t * stride_bt + page, mask=valid, other=0).to(tl.int64)
        kptr = K + blk[:, None] * stride_kb + within[:, None] * stride_ko + offs_d[None, :]
        kmask = valid[:, None] & (offs_d[None, :] < D)
        if FP8:
            bits = tl.load(kptr, mask=kmask, other=0)
            scale = tl.load(KSCALE + blk * stride_sb + within, mask=valid, other=0.0)
            # (with F16 q is fp16 by now: e4m3 -> fp16 is one conversion per two values, -> bf16 an F2F more each)
            k, scale = _fp8_keys(bits, scale, q, SOFT_FP8, FP8_DOT)
        else:
            k = tl.load(kptr, mask=kmask, other=0.0).to(q.dtype)
            scale = tl.full([BLOCK_N], 1.0, tl.float32)
        if PERMUTE_D:
            k = _fragment_order(k, BLOCK_N, DP)
        logit = _weighted_relu_scores(q, k, w, scale, IEEE, KEYS_AS_M)
        logit = tl.where(valid, logit, float("-inf"))
        tl.store(OUT + t * stride_ot + offs_n, logit, mask=offs_n < out_cols)


def _check_qw(q: torch.Tensor, weights: torch.Tensor, fp8_q: bool = False) -> torch.Tensor:
    """Check q and the head weights; returns the weights with unit stride along heads (the kernels assume it: a
    transposed view would be read as another token's weights)."""
    if q.dim() != 3:
        raise Glm5labError(f"q must be [tokens, heads, D], got shape {tuple(q.shape)}")
    if q.dtype not in _KEY_DTYPES and not (fp8_q and q.dtype == torch.float8_e4m3fn):
        raise Glm5labError(f"q must be float16/bfloat16/float32{'/float8_e4m3fn' if fp8_q else ''}, got {q.dtype}")
    if weights.shape != q.shape[:2]:
        raise Glm5labError(f"weights must be [tokens, heads] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    if q.stride(-1) != 1:
        raise Glm5labError("q must be contiguous in its last dimension")
    return weights.contiguous()


# fp8 keys: 64-key tiles below this many keys a call (v52, H100, CUDA graphs, scripts/logits_ab.py, two boards:
# 1.08-1.23x faster at 4k x 1-128 rows and 64k x 1 row, 1.01-1.04x at 64k x 32; 0.95-0.96x at 64k x 128 rows; more
# tiles a program, pipelined, or 8 warps were slower in every cell, bf16 is the same at 64 and 128 keys). v55, against
# the 128-key tiles with the fp16 dot: the line moved from "up to 4M" to below 3M. v56, with the keys . q^T dot on
# Hopper (H100, 3 interleaved rounds, 4k-64k x 1-128 rows): 64 keys 1.01-1.10x faster at 8-128 rows below 2M keys a
# call, 128 keys 1.02-1.09x at 2M (32 x 64k, 128 x 16k) and beyond, so the line is below 2M (single rows of 32k-64k:
# 128 keys by 0.3-0.5 us, not taken)
FP8_SMALL_TILE_MAX_KEYS = 2 * 1024 * 1024
# an e4m3 q against fp8 keys (the fp8 x fp8 dot) in 128-key tiles: two tiles a program, pipelined (v58, H100, CUDA
# graphs, 3 interleaved rounds, two boards: 1.015-1.029x faster than one tile at 2M-8M keys a call; at 128k-512k keys
# 0.89-0.98x the time too, but there the 64-key tile is the default, as fast or faster where both ran; 4k-32k keys
# a call: 1.08-1.22x slower)
FP8_DOT_TILES = 2
# fp8 keys with a bf16 q: the dot in fp16 from this many keys a program (v55, H100, 3 interleaved rounds: at 128-key
# tiles 1.02-1.24x the bf16 dot at 4k-64k x 1-128 rows; at 64-key tiles 0.84-0.94x, q's per-head scaling a program
# costing more than the conversions it saves)
F16_DOT_MIN_KEYS = 128


def _fp8_dot_plan(q: torch.Tensor, fp8: bool, soft_fp8: bool | None, capability):
    """(q, soft_fp8, fp8_dot) for fp8 keys or not: the integer decode of the keys by default on GPUs before SM89
    (no e4m3 there); an e4m3 q meets fp8 keys in the fp8 x fp8 dot where the GPU has e4m3, and is widened to bf16
    (exact) otherwise."""
    if soft_fp8 is None:
        soft_fp8 = capability is not None and capability < (8, 9)
    fp8_dot = q.dtype == torch.float8_e4m3fn and fp8 and not soft_fp8
    if q.dtype == torch.float8_e4m3fn and not fp8_dot:
        q = q.to(torch.bfloat16)
    return q, soft_fp8, fp8_dot


def keys_as_m_default(fp8: bool, capability: tuple[int, int] | None) -> bool:
    """Whether the logits dot runs as keys . q^T (see _weighted_relu_scores) on a GPU of this compute capability (None:
    not a GPU): for fp8 keys on Hopper (v56, H100, CUDA graphs, 3 interleaved rounds: 1.01-1.14x faster at 64-key
    tiles, 1.05-1.12x at 128 at 4k-64k x 1-128 rows); bf16 keys there read at 0.92-0.94 of the copy roofline against
    q . keys^T's 0.96-0.98 at 32-128 x 64k, and other GPUs (mma.sync, no wgmma) are not measured."""
    return fp8 and capability is not None and capability[0] == 9


def indexer_logits_decode(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None,
                          out: torch.Tensor | None = None, block_n: int | None = None,
                          soft_fp8: bool | None = None, num_warps: int = 4, tiles: int | None = None,
                          num_stages: int = 2, f16_dot: bool | None = None,
                          keys_as_m: bool | None = None, permute_d: bool = False) -> torch.Tensor:
    """Decode logits of each query row against its own paged context: float32 [T, max_len].

    q [T, H, D] fp16/bf16/fp32 or e4m3 (below); weights [T, H] (scales folded in); k_cache plain [blocks, page, D]
    or fp8 uint8 [blocks, page, D+4]; block_table [T, max_blocks] int (row t's pages, in order); seq_lens [T] (row t
    sees positions 0..seq_lens[t]-1). Columns >= seq_lens[t] are -inf. Every entry of the output is written. Block
    ids are not checked against the cache (that needs a host sync every decode step, as vLLM's op would pay).
    soft_fp8 decodes fp8 keys with integer ops instead of the hardware conversion (default: only on GPUs before
    SM89, which have no e4m3 support). Tiling: block_n keys a tile, `tiles` tiles a program one after another
    (default one; FP8_DOT_TILES for an e4m3 q's 128-key tiles), num_stages how many tiles' loads in flight (default
    2), num_warps warps a program. f16_dot runs fp8 keys' dot in fp16 with q scaled per head by a power of two: the
    same products, but e4m3 -> fp16 is one instruction per two values where e4m3 -> bf16 adds an F2F per value; the
    scaling is a fixed cost a program (default: a bf16 q and at least F16_DOT_MIN_KEYS keys a program, NOTES.md
    v55); False keeps the dot in q's dtype. keys_as_m takes the dot as keys . q^T (the keys the MMA's M dimension: a
    wgmma on Hopper) rather than q . keys^T (default: keys_as_m_default, fp8 keys on Hopper). permute_d sums q and
    the keys over their last dimension in an order that keeps each MMA fragment's values contiguous in memory
    (_fragment_order); the logits are the same up to fp32 rounding. An e4m3 q (vLLM's indexer quantizes q so, its
    scale folded into the weights) meets fp8 keys in an fp8 x fp8 dot, neither converted, where the GPU has e4m3
    (SM89 on); elsewhere it is widened to bf16 (exact).
    """
    weights = _check_qw(q, weights, fp8_q=True)
    block_n = power_of_two("block_n", block_n, 16)
    at_least_one(tiles=tiles, num_stages=num_stages)
    T, H, D = q.shape
    fp8 = is_fp8_cache(k_cache, D)
    if fp8:
        values, scales = fp8_cache_views(k_cache, D)
        kt, kscale, stride_sb = values, scales, scales.stride(0)
    elif k_cache.dim() == 3 and k_cache.shape[-1] == D and k_cache.dtype in _KEY_DTYPES:
        kt, kscale, stride_sb = k_cache, k_cache, 0
        if k_cache.stride(-1) != 1:
            raise Glm5labError("k_cache must be contiguous in its last dimension")
    else:
        raise Glm5labError(f"k_cache must be [blocks, block_size, {D}] fp16/bf16/fp32 or uint8 "
                           f"[blocks, block_size, {D + 4}] (fp8 layout), got {k_cache.dtype} {tuple(k_cache.shape)}")
    page = k_cache.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != T:
        raise Glm5labError(f"block_table must be [tokens={T}, max_blocks], got {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise Glm5labError(f"block_table must be int32 or int64, got {block_table.dtype}")
    seq_lens = index_vector("seq_lens", seq_lens, T)
    require_launch_device(q=q, weights=weights, k_cache=k_cache, block_table=block_table, seq_lens=seq_lens, out=out)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if max_len is None:
        max_len = int(seq_lens.max()) if T else 0
    if max_len < 0:
        raise Glm5labError(f"max_len must be >= 0, got {max_len}")
    if max_len > block_table.shape[1] * page:
        raise Glm5labError(f"max_len {max_len} exceeds the block table's reach "
                           f"({block_table.shape[1]} blocks x {page})")
    if out is None:
        out = torch.empty((T, max_len), dtype=torch.float32, device=q.device)
    elif out.shape != (T, max_len) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise Glm5labError(f"out must be float32 [{T}, {max_len}] contiguous in its last dimension, got "
                           f"{out.dtype} {tuple(out.shape)}")
    if T == 0 or max_len == 0:
        return out
    capability = cuda_capability(q.device) if q.is_cuda else None
    q, soft_fp8, fp8_dot = _fp8_dot_plan(q, fp8, soft_fp8, capability)
    if kt.dtype != q.dtype and not fp8:
        kt = kt.to(q.dtype)  # rare: mixed dtypes; keep the kernel single-typed
    if f16_dot and not (fp8 and q.dtype in (torch.float16, torch.bfloat16)):
        raise Glm5labError(f"f16_dot needs an fp8 key cache and an fp16/bf16 q, got {k_cache.dtype} keys "
                           f"and {q.dtype} q")
    if block_n is None:  # keys a tile: larger tiles on a GPU amortize the q load, except fp8's in small grids
        block_n = 64 if not q.is_cuda or (fp8 and T * max_len < FP8_SMALL_TILE_MAX_KEYS) else 128
    if tiles is None:
        tiles = FP8_DOT_TILES if fp8_dot and block_n == 128 and q.is_cuda else 1
    if f16_dot is None:
        f16_dot = fp8 and q.dtype == torch.bfloat16 and block_n * tiles >= F16_DOT_MIN_KEYS
    if keys_as_m is None:
        keys_as_m = keys_as_m_default(fp8, capability)
    grid = (T, cdiv(max_len, block_n * tiles))
    _decode_logits_kernel[grid](
        q, weights, kt, kscale, block_table, seq_lens, out,
        q.stride(0), q.stride(1), weights.stride(0), kt.stride(0), kt.stride(1), stride_sb,
        block_table.stride(0), out.stride(0), max_len,
        H=H, D=D, HP=_pow2(H, 16), DP=_pow2(D, 32 if fp8_dot else 16), PAGE=page, BLOCK_N=block_n, TILES=tiles,
        STAGES=num_stages if tiles > 1 else 1,
        FP8=fp8, IEEE=_dot_in_fp32(q.dtype) and not f16_dot, SOFT_FP8=bool(soft_fp8 and fp8), F16=bool(f16_dot),
        KEYS_AS_M=bool(keys_as_m), PERMUTE_D=bool(permute_d), FP8_DOT=fp8_dot, num_warps=num_warps)
    return out


@triton.jit
def _prefill_logits_kernel(Q, W, K, KSCALE, KS, KE, OUT, T,
                           stride_qt, stride_qh, stride_wt, stride_kt, stride_ot, out_cols,
                           H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr,
                           IEEE: tl.constexpr, FP8: tl.constexpr, SOFT_FP8: tl.constexpr, FP8_DOT: tl.constexpr,
                           KEYS_AS_M: tl.constexpr):
    """BLOCK_M query tokens against TILES tiles of BLOCK_N keys (absolute key index), one tile after another with
    the query tile and weights loaded once; every query row t scores keys [ks_t, ke_t) and writes column
    (key - ks_t). FP8: the keys are e4m3 bytes with a float32 scale a key, converted as the decode kernel converts
    them (FP8_DOT: q is e4m3 too and nothing is converted), the scale applied after the heads' sum. KEYS_AS_M takes
    the dot as keys . q^T: the heads' sum then runs along the MMA's N (within a warp) rather than across the warps
    that hold q's rows."""
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < T
    ks = tl.load(KS + offs_m, mask=row_ok, other=0)
    ke = tl.load(KE + offs_m, mask=row_ok, other=0)
    lo = tl.min(tl.where(row_ok & (ke > ks), ks, 2147483647), axis=0)
    hi = tl.max(tl.where(row_ok & (ke > ks), ke, 0), axis=0)
    first = tl.program_id(1) * TILES * BLOCK_N
    if (first < hi) & (first + TILES * BLOCK_N > lo):
        offs_d = tl.arange(0, DP)
        # q tile flattened to [BLOCK_M * HP, DP]: row r = (token r // HP, head r % HP)
        r = tl.arange(0, BLOCK_M * HP)
        rt = m0 + r // HP
        rh = r % HP
        rmask = (rt < T) & (rh < H)
        q = tl.load(Q + rt[:, None].to(tl.int64) * stride_qt + rh[:, None] * stride_qh + offs_d[None, :],
                    mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
        w = tl.load(W + rt.to(tl.int64) * stride_wt + rh, mask=rmask, other=0.0).to(tl.float32)
        # only the tiles that meet some row's window [lo, hi) (causal rows: the later tiles of the last programs)
        i_lo = tl.maximum(lo - first, 0) // BLOCK_N
        i_hi = tl.minimum(tl.cdiv(hi - first, BLOCK_N), TILES)
        for i in tl.range(i_lo, i_hi, num_stages=STAGES):
            offs_n = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
            kptr = K + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :]
            kmask = (offs_n[:, None] < hi) & (offs_d[None, :] < D)
            if FP8:
                bits = tl.load(kptr, mask=kmask, other=0)
                scale = tl.load(KSCALE + offs_n, mask=offs_n < hi, other=0.0)
                k, scale = _fp8_keys(bits, scale, q, SOFT_FP8, FP8_DOT)
            else:
                k = tl.load(kptr, mask=kmask, other=0.0).to(q.dtype)
                scale = tl.full([BLOCK_N], 1.0, tl.float32)
            s = _scores_dot(q, k, IEEE, KEYS_AS_M)
            if KEYS_AS_M:     # s [BLOCK_N, BLOCK_M*HP]
                s = tl.maximum(s, 0.0) * w[None, :]
                logit = tl.trans(tl.sum(tl.reshape(s, [BLOCK_N, BLOCK_M, HP]), axis=2) * scale[:, None])
            else:             # s [BLOCK_M*HP, BLOCK_N]
                s = tl.maximum(s, 0.0) * w[:, None]
                logit = tl.sum(tl.reshape(s, [BLOCK_M, HP, BLOCK_N]), axis=1) * scale[None, :]  # [BLOCK_M, BLOCK_N]
            col = offs_n[None, :] - ks[:, None]
            ok = row_ok[:, None] & (offs_n[None, :] >= ks[:, None]) & (offs_n[None, :] < ke[:, None])
            ok = ok & (col < out_cols)
            tl.store(OUT + offs_m[:, None].to(tl.int64) * stride_ot + col, logit, mask=ok)


def _prefill_keys(k, D: int):
    """(key tensor, scale tensor or None, fp8?) from the prefill's keys: a [S, D] fp16/bf16/fp32 tensor, or vLLM's
    fp8 pair (values [S, D] float8_e4m3fn or their uint8 bytes, scales [S] float32) as its fp8_mqa_logits takes
    them."""
    if isinstance(k, (tuple, list)):
        if len(k) != 2:
            raise Glm5labError(f"fp8 keys must be a pair (values [keys, {D}], scales [keys]), got {len(k)} tensors")
        values, scales = k
        if values.dim() != 2 or values.shape[1] != D or values.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise Glm5labError(f"fp8 key values must be [keys, {D}] float8_e4m3fn or uint8, got {values.dtype} "
                               f"{tuple(values.shape)}")
        if scales.dtype != torch.float32 or scales.reshape(-1).shape != (values.shape[0],):
            raise Glm5labError(f"fp8 key scales must be float32 [{values.shape[0]}] (one a key), got {scales.dtype} "
                               f"{tuple(scales.shape)}")
        if values.stride(-1) != 1:
            raise Glm5labError("fp8 key values must be contiguous in their last dimension")
        return values.view(torch.uint8), scales.reshape(-1).contiguous(), True
    if k.dim() != 2 or k.shape[1] != D or k.dtype not in _KEY_DTYPES:
        raise Glm5labError(f"k must be [keys, {D}] fp16/bf16/fp32 or an fp8 pair (values, scales), got {k.dtype} "
                           f"{tuple(k.shape)}")
    if k.stride(-1) != 1:
        raise Glm5labError("k must be contiguous in its last dimension")
    return k, None, False


def prefill_keys_as_m_default(capability: tuple[int, int] | None) -> bool:
    """Whether the prefill logits' dot runs as keys . q^T on a GPU of this compute capability (None: not a GPU): on
    Hopper. q . keys^T puts a token's 32 heads on rows that two warps of the wgmma hold, so their sum goes through
    shared memory every key tile -- the sm_90 build's key loop (e4m3 q, fp8 pair, 64 keys) is 753 instructions with
    48 STS, 60 LDS, 100 SHFL and 7 barriers, against keys . q^T's 299 with 2 / 10 / 16 / 2 and the same MMA work.
    Timed on an H100 (NOTES v61): 1.22-1.56x faster at the same tiling, e4m3 q and bf16 alike. sm_100's build drops
    1,537 -> 308 too but runs nowhere here; sm_120's is unchanged (751 / 760) and sm_86's soft decode grows."""
    return capability is not None and capability[0] == 9


def prefill_tiling_default(capability: tuple[int, int] | None, keys_as_m: bool) -> tuple[int, int, int]:
    """(keys a tile, key tiles a program, pipeline stages) of the prefill logits: 64-key tiles, 16 a program with
    3 tiles' loads in flight where the dot is keys . q^T on Hopper (H100s, NOTES v61: 1.03-1.75x faster than one tile
    a program over chunks of 256-8192 tokens and 4k-64k keys, within ~8% of the best of 28 tilings at each); one tile
    a program elsewhere -- q . keys^T's heads' sum through shared memory left more tiles nothing to gain (H200, v60),
    and nothing here times other GPUs."""
    if keys_as_m and capability is not None and capability[0] == 9:
        return 64, 16, 3
    return 64, 1, 2


def indexer_logits_prefill(q: torch.Tensor, weights: torch.Tensor, k, ks: torch.Tensor, ke: torch.Tensor,
                           max_len: int | None = None, block_m: int | None = None, block_n: int | None = None,
                           soft_fp8: bool | None = None, tiles: int | None = None, num_stages: int | None = None,
                           num_warps: int = 4, keys_as_m: bool | None = None) -> torch.Tensor:
    """Prefill logits: float32 [T, max_len], row t scoring keys k[ks[t]:ke[t]] (column j = key ks[t]+j,
    i.e. the request-local position when ks[t] is the request's first key); -inf elsewhere.

    q [T, H, D] fp16/bf16/fp32 or e4m3; weights [T, H]; k the gathered keys of the requests in this chunk, as
    vLLM's fp8_mqa_logits takes them: [S, D] fp16/bf16/fp32, or the pair (values [S, D] e4m3 (or its uint8
    bytes), scales [S] float32 > 0) that vLLM gathers from its fp8 index-key cache -- read as they are, no
    dequantized copy. An e4m3 q meets fp8 keys in an fp8 x fp8 dot where the GPU has e4m3 (SM89 on), and is widened
    to bf16 (exact) elsewhere; soft_fp8 decodes the keys with integer ops (default: GPUs before SM89), as
    `indexer_logits_decode` does. ks/ke [T] int. For causal prefill of one sequence from position 0: ks = 0,
    ke = position + 1. Tiling: block_m tokens (all heads) a tile against block_n keys (default: as many tokens as
    make 128 q rows; at most 256 rows), `tiles` key tiles a program one after another (the query tile loaded once;
    num_stages tiles' loads in flight); keys_as_m takes the dot as keys . q^T (default:
    prefill_keys_as_m_default). block_n, tiles and num_stages left out: prefill_tiling_default.
    """
    weights = _check_qw(q, weights, fp8_q=True)
    block_n = power_of_two("block_n", block_n, 16)
    at_least_one(tiles=tiles, num_stages=num_stages, block_m=block_m)
    T, H, D = q.shape
    kt, kscale, fp8 = _prefill_keys(k, D)
    S = kt.shape[0]
    ks, ke = index_vector("ks", ks, T), index_vector("ke", ke, T)
    require_launch_device(q=q, weights=weights, keys=kt, key_scales=kscale if fp8 else None, ks=ks, ke=ke)
    if T and (bool((ks < 0).any()) or bool((ke > S).any()) or bool((ke < ks).any())):
        raise Glm5labError(f"key windows [ks, ke) must satisfy 0 <= ks <= ke <= {S}")
    if max_len is None:
        max_len = int((ke - ks).max()) if T else 0
    if max_len < 0:
        raise Glm5labError(f"max_len must be >= 0, got {max_len}")
    out = torch.full((T, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or max_len == 0 or S == 0:
        return out
    capability = cuda_capability(q.device) if q.is_cuda else None
    q, soft_fp8, fp8_dot = _fp8_dot_plan(q, fp8, soft_fp8, capability)
    if keys_as_m is None:
        keys_as_m = prefill_keys_as_m_default(capability)
    default_n, default_tiles, default_stages = prefill_tiling_default(capability, keys_as_m)
    block_n = block_n or default_n
    tiles = tiles or default_tiles
    num_stages = num_stages or default_stages
    if not fp8 and kt.dtype != q.dtype:
        kt = kt.to(q.dtype)
    HP = _pow2(H, 16)
    block_m_default = block_m is None
    block_m = max(1, min(_pow2(block_m or 16), _pow2(T)))
    # the flattened [BLOCK_M*HP, D] q tile must stay a sensible size
    while block_m > 1 and block_m * HP > (128 if block_m_default else 256):
        block_m //= 2
    if block_m * HP < 16:
        block_m = 16 // HP
    grid = (cdiv(T, block_m), cdiv(S, block_n * tiles))
    _prefill_logits_kernel[grid](
        q, weights, kt, kscale if fp8 else kt, ks, ke, out, T,
        q.stride(0), q.stride(1), weights.stride(0), kt.stride(0), out.stride(0), max_len,
        H=H, D=D, HP=HP, DP=_pow2(D, 32 if fp8_dot else 16), BLOCK_M=block_m, BLOCK_N=block_n, TILES=tiles,
        STAGES=num_stages if tiles > 1 else 1,
        IEEE=_dot_in_fp32(q.dtype), FP8=fp8, SOFT_FP8=bool(soft_fp8 and fp8), FP8_DOT=fp8_dot,
        KEYS_AS_M=bool(keys_as_m), num_warps=num_warps)
    return out


# ----------------------------------------------------------------------------------------------- top-k
@triton.jit
def _order_key(x):
    """float32 -> int32 with the same (total) order as the floats; -0.0 maps to +0.0's key."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _pick_digit(hist, above, prefix, K, shift):
    """One radix level: the digit j whose bin holds the k-th largest of the candidates (`above` positions already
    lie above the prefix); returns (above, prefix) with j appended at `shift`. One scan, then two reductions that do
    not wait for each other: bins up to j reach K, and the count above bin j is the largest suffix count that does
    not (the suffix counts fall with the digit). A row with fewer than K valid positions, which takes them all,
    reaches K nowhere. Third: how many lie above the prefix or carry it with digit j (== K: no tie is left to split,
    the later digits need not be picked; unused, the compiler drops it)."""
    suffix = tl.cumsum(hist, axis=0, reverse=True)                       # count with digit >= each bin's
    reach = (above + suffix) >= K
    j = tl.maximum(tl.sum(reach.to(tl.int32), axis=0) - 1, 0)
    through_j = tl.min(tl.where(reach, above + suffix, 2147483647), axis=0)
    return above + tl.max(tl.where(reach, 0, suffix), axis=0), prefix + (j.to(tl.int64) << shift), through_j


@triton.jit
def _final_threshold(prefix, above, exact, K):
    """The order key to select above, and how many ties at it to take: after an exact pick (the K largest are exactly
    the positions at or above `prefix`), everything at or above the prefix and no tie."""
    thr = (tl.maximum(prefix - exact.to(tl.int64), 0) - 2147483648).to(tl.int32)
    return thr, tl.where(exact, 0, K - above)


@triton.jit
def _digit_hist(x, m, prefix, shift, LEVEL: tl.constexpr):
    """Histogram of the 8-bit digit at `shift` (level LEVEL) of the logits `x` whose higher digits equal
    `prefix`'s (unsigned space u = key + 2**31)."""
    u = _order_key(x).to(tl.int64) + 2147483648
    if LEVEL > 0:
        m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
    return tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=m)


@triton.jit
def _select_block(key, offs, m, K, thr, need_eq, take_all, written, eq_seen):
    """One block of `_select_range`: order keys `key` at positions `offs` (valid where `m`); returns the positions
    to store at, which to store, and the updated (written, eq_seen)."""
    eq = (m & (key == thr)).to(tl.int32)
    eq_rank = tl.cumsum(eq, axis=0) - eq + eq_seen
    sel = m & ((key > thr) | ((eq > 0) & (eq_rank < need_eq)) | take_all)
    sel_i = sel.to(tl.int32)
    pos = tl.cumsum(sel_i, axis=0) - sel_i + written
    return pos, sel & (pos < K), written + tl.sum(sel_i, axis=0), eq_seen + tl.sum(eq, axis=0)


@triton.jit
def _select_range(base, obase, lo, hi, K, thr, need_eq, take_all, written, eq_seen, BLOCK: tl.constexpr):
    """The selection rule, over positions [lo, hi) of one row: take every key above the k-th key `thr`, and
    the first `need_eq` keys equal to it (lowest position first; `eq_seen` ties came before lo); write the
    chosen positions in ascending order from output slot `written`. Returns the next free slot."""
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        key = _order_key(tl.load(base + offs, mask=m, other=0.0))
        pos, store, written, eq_seen = _select_block(key, offs, m, K, thr, need_eq, take_all, written, eq_seen)
        tl.store(obase + pos, offs, mask=store)
    return written


@triton.jit
def _write_selected(base, obase, n, K, thr, need_eq, take_all, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Shared tail of the one-program-per-row top-k kernels: the chosen positions of the whole row in
    ascending order, then -1."""
    zero = tl.zeros([], dtype=tl.int32)
    written = _select_range(base, obase, 0, n, K, thr, need_eq, take_all, zero, zero, BLOCK)
    for start in range(0, K, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        tl.store(obase + offs, tl.full([BLOCK_K], -1, tl.int32), mask=(offs >= written) & (offs < K))


@triton.jit
def _topk_kernel(L, LEN, OUT, stride_l, stride_o, C, K,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    n = tl.minimum(tl.load(LEN + row).to(tl.int32), C)
    n = tl.maximum(n, 0)
    base = L + row.to(tl.int64) * stride_l
    obase = OUT + row.to(tl.int64) * stride_o
    digits = tl.arange(0, 16).to(tl.int64)
    # 1) radix select, 4 bits per pass, in the unsigned space u = key + 2**31 (int64 scalars only):
    #    `ans` = the largest threshold with count(u >= ans) >= K among the row's valid positions
    ans = tl.zeros([], dtype=tl.int64)
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        cand = (ans + (digits << shift) - 2147483648).to(tl.int32)      # back to the signed key space
        cnt = tl.zeros([16], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            key = _order_key(tl.load(base + offs, mask=m, other=0.0))
            hit = (key[:, None] >= cand[None, :]) & m[:, None]
            cnt += tl.sum(hit.to(tl.int32), axis=0)
        j = tl.maximum(tl.sum((cnt >= K).to(tl.int32), axis=0) - 1, 0)
        ans = ans + (j.to(tl.int64) << shift)
    thr = (ans - 2147483648).to(tl.int32)
    take_all = n <= K
    # 2) how many strictly above the threshold; the rest of the K come from ties, lowest position first
    gt_total = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        key = _order_key(tl.load(base + offs, mask=m, other=0.0))
        gt_total += tl.sum((m & (key > thr)).to(tl.int32), axis=0)
    # 3) write the chosen positions in ascending order, then -1
    _write_selected(base, obase, n, K, thr, K - gt_total, take_all, BLOCK, BLOCK_K)


@triton.jit
def _topk_hist_kernel(L, LEN, OUT, stride_l, stride_o, C, K,
                      BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Same contract as _topk_kernel; the radix select takes 8 bits per pass with tl.histogram (4 passes, fewer when
    a level's pick leaves no tie to split: v52), and the count above the threshold falls out of the select, so 5
    passes over the row at most instead of 10."""
    row = tl.program_id(0)
    n = tl.minimum(tl.load(LEN + row).to(tl.int32), C)
    n = tl.maximum(n, 0)
    base = L + row.to(tl.int64) * stride_l
    obase = OUT + row.to(tl.int64) * stride_o
    prefix = tl.zeros([], dtype=tl.int64)      # chosen high digits, unsigned space u = key + 2**31
    above = tl.zeros([], dtype=tl.int32)       # valid positions whose u is above the chosen prefix
    exact = n < 0                              # the K largest found without a tie: no more passes
    for p in tl.static_range(4):
        if not exact:
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                m = offs < n
                hist += _digit_hist(tl.load(base + offs, mask=m, other=0.0), m, prefix, shift, p)
            above, prefix, through_j = _pick_digit(hist, above, prefix, K, shift)
            exact = through_j == K
    thr, need_eq = _final_threshold(prefix, above, exact, K)
    _write_selected(base, obase, n, K, thr, need_eq, n <= K, BLOCK, BLOCK_K)


@triton.jit
def _topk_hist_row_kernel(L, LEN, OUT, stride_l, stride_o, C, K, ROW: tl.constexpr, BLOCK_K: tl.constexpr):
    """_topk_hist_kernel for rows of at most ROW columns: the row is loaded once and kept in registers (as order
    keys) through the (up to) four histogram passes and the write, instead of being read from L2 each time."""
    row = tl.program_id(0)
    n = tl.maximum(tl.minimum(tl.load(LEN + row).to(tl.int32), C), 0)
    base = L + row.to(tl.int64) * stride_l
    obase = OUT + row.to(tl.int64) * stride_o
    offs = tl.arange(0, ROW)
    key = _order_key(tl.load(base + offs, mask=offs < C, other=0.0))        # not waiting for the length
    m = offs < n
    uk = key.to(tl.uint32, bitcast=True) ^ 0x80000000                    # u = key + 2**31, as unsigned 32 bits
    prefix = tl.zeros([], dtype=tl.int64)
    above = tl.zeros([], dtype=tl.int32)
    exact = n < 0
    for p in tl.static_range(4):
        if not exact:
            shift = 24 - 8 * p
            mm = m
            if p > 0:
                mm = m & ((uk >> (shift + 8)) == (prefix >> (shift + 8)).to(tl.uint32))
            hist = tl.histogram(((uk >> shift) & 255).to(tl.int32), 256, mask=mm)
            above, prefix, through_j = _pick_digit(hist, above, prefix, K, shift)
            exact = through_j == K
    thr, need_eq = _final_threshold(prefix, above, exact, K)
    zero = tl.zeros([], dtype=tl.int32)
    pos, store, _, _ = _select_block(key, offs, m, K, thr, need_eq, n <= K, zero, zero)
    tl.store(obase + pos, offs, mask=store)
    filled = tl.minimum(n, K)
    for start in range(0, K, BLOCK_K):
        o = start + tl.arange(0, BLOCK_K)
        tl.store(obase + o, tl.full([BLOCK_K], -1, tl.int32), mask=(o >= filled) & (o < K))


# rows up to this many columns run the register-resident hist kernel; longer rows stream through L2 once a pass.
# v51 (H100, CUDA graphs): 4k columns 1.44-1.53x faster in registers; 16k 0.18-0.78x (16 warps' registers spill)
HIST_WHOLE_ROW_MAX = 4096
HIST_ROW_WARPS = 8


# ---- "split": the same radix select spread over segments of each row (many programs per row), for
# decode batches too small to fill the GPU with one program per row. One launch a level: the segments add their
# histogram of the level's digit into that level's global histogram (all four zeroed by one memset); each program
# of the next level picks the level's digit from it, starting from the digits before it, which the level's first
# segment left in PICKS (v52: one pick a launch, not one per level so far). The last level also leaves each
# segment's own counts for the ordered write. So: 1 memset + 5 launches (4 levels, the write), each over all
# segments of all rows (v51: 13 kernels and 3 memsets became 7 launches and 1 memset; v52: the count pass is gone).
@triton.jit
def _split_prefix(HIST, PICKS, row, T, K, LEVELS: tl.constexpr):
    """(prefix, above) after the first LEVELS digits: the chosen high digits (unsigned space u = key + 2**31)
    and how many valid positions lie above them. The last digit is picked from its level's global histogram
    [4, T, 256], the ones before it read from PICKS [4, T, 2] (int64), where LEVELS - 1's launch left them."""
    prefix = tl.zeros([], dtype=tl.int64)
    above = tl.zeros([], dtype=tl.int32)
    if LEVELS > 1:
        prefix = tl.load(PICKS + ((LEVELS - 1) * T + row) * 2)
        above = tl.load(PICKS + ((LEVELS - 1) * T + row) * 2 + 1).to(tl.int32)
    if LEVELS > 0:
        hist = tl.load(HIST + ((LEVELS - 1) * T + row) * 256 + tl.arange(0, 256))
        above, prefix, _ = _pick_digit(hist, above, prefix, K, 32 - 8 * LEVELS)
    return prefix, above


# The split kernels load their segment's first block before they read the levels' histograms back, and without
# waiting for the row's length (masked to the row's columns, the length applied after): the three round trips overlap
# (at 1-32 rows a segment is one block). The histograms' atomic adds are relaxed: the next launch orders them.
@triton.jit
def _split_hist_kernel(L, LEN, HIST, PICKS, SEGCOUNT, stride_l, C, SEG, S, T, K, LEVEL: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Level LEVEL's digit histogram of one segment, added into the level's global histogram; the first segment
    leaves the digits so far in PICKS for the next launch. The last level also stores the segment's own counts,
    SEGCOUNT[row, seg, b] = how many of its positions lie above the 3-digit prefix or carry it with a last digit
    >= b (b = 0..256): the write kernel reads its segment's place from them."""
    row = tl.program_id(0)
    seg = tl.program_id(1)
    seg0 = seg * SEG
    n = tl.maximum(tl.minimum(tl.load(LEN + row).to(tl.int32), C), 0)
    hi = tl.minimum(seg0 + SEG, n)
    base = L + row.to(tl.int64) * stride_l
    offs = seg0 + tl.arange(0, BLOCK)
    x = tl.load(base + offs, mask=offs < tl.minimum(seg0 + SEG, C), other=0.0)     # not waiting for the length
    prefix, above_prefix = _split_prefix(HIST, PICKS, row, T, K, LEVEL)
    if LEVEL > 0:
        if seg == 0:
            tl.store(PICKS + (LEVEL * T + row) * 2, prefix)
            tl.store(PICKS + (LEVEL * T + row) * 2 + 1, above_prefix.to(tl.int64))
    shift = 24 - 8 * LEVEL
    above_thr = (prefix + 255 - 2147483648).to(tl.int32)     # last level: keys above every key with this prefix
    hist = _digit_hist(x, offs < hi, prefix, shift, LEVEL)
    above = tl.sum(((offs < hi) & (_order_key(x) > above_thr)).to(tl.int32), axis=0)
    for start in range(seg0 + BLOCK, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < hi, other=0.0)
        hist += _digit_hist(x, offs < hi, prefix, shift, LEVEL)
        if LEVEL == 3:
            above += tl.sum(((offs < hi) & (_order_key(x) > above_thr)).to(tl.int32), axis=0)
    if seg0 < n:
        tl.atomic_add(HIST + (LEVEL * T + row) * 256 + tl.arange(0, 256), hist, sem="relaxed")
    if LEVEL == 3:   # above + (how many with the prefix have a last digit >= b); every segment, empty ones too
        bins = tl.arange(0, 256)
        out = SEGCOUNT + (row * S + seg).to(tl.int64) * 257
        tl.store(out + bins, above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist)
        tl.store(out + 256, above)


@triton.jit
def _split_write_kernel(L, LEN, HIST, PICKS, SEGCOUNT, OUT, stride_l, stride_o, C, K, SEG, S, T,
                        SP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    seg = tl.program_id(1)
    seg0 = seg * SEG
    n = tl.maximum(tl.minimum(tl.load(LEN + row).to(tl.int32), C), 0)
    hi = tl.minimum(seg0 + SEG, n)
    base = L + row.to(tl.int64) * stride_l
    obase = OUT + row.to(tl.int64) * stride_o
    offs = seg0 + tl.arange(0, BLOCK)
    x = tl.load(base + offs, mask=offs < tl.minimum(seg0 + SEG, C), other=0.0)
    prefix, above = _split_prefix(HIST, PICKS, row, T, K, 4)
    thr = (prefix - 2147483648).to(tl.int32)
    take_all = n <= K
    need_eq = K - above
    # the earlier segments' counts above / equal to the threshold, from their last-level counts at digit j, j + 1
    j = (prefix & 255).to(tl.int32)
    segs = tl.arange(0, SP)
    before = segs < seg
    counts = SEGCOUNT + (row * S + segs).to(tl.int64) * 257
    ge_j = tl.load(counts + j, mask=before, other=0)
    gt_j = tl.load(counts + j + 1, mask=before, other=0)
    gt_before = tl.sum(gt_j, axis=0)
    eq_before = tl.sum(ge_j - gt_j, axis=0)
    written = gt_before + tl.minimum(eq_before, need_eq)
    eq_seen = eq_before
    if take_all:
        written = seg0
    pos, store, written, eq_seen = _select_block(_order_key(x), offs, offs < hi, K, thr, need_eq, take_all, written,
                                                 eq_seen)
    tl.store(obase + pos, offs, mask=store)
    _select_range(base, obase, seg0 + BLOCK, hi, K, thr, need_eq, take_all, written, eq_seen, BLOCK)
    if seg == 0:   # -1 after the chosen ones: min(K, n) positions are filled
        filled = tl.minimum(n, K)
        for start in range(0, K, BLOCK_K):
            o = start + tl.arange(0, BLOCK_K)      # (not `offs`: BLOCK_K need not be BLOCK, and Triton keeps shapes)
            tl.store(obase + o, tl.full([BLOCK_K], -1, tl.int32), mask=(o >= filled) & (o < K))


# the split kernels' warps a program, and their block of columns: 512 for short rows in small batches (few
# segments, each one block), else 1024 (v52, H100, CUDA graphs: 4k x 1-32 rows and 16k x 1 row 1.07-1.13x faster at
# 512; 64k x 1 row (128 segments), and batches whose segments loop over several blocks, 1.05-1.12x slower)
SPLIT_WARPS = 4


def split_block(columns: int, rows: int) -> int:
    return 512 if columns <= 16384 and columns * rows <= 512 * 512 else 1024


def _topk_split(logits, k, lengths, out, block, seg):
    T, C = logits.shape
    block = block or split_block(C, T)
    if seg is None:   # enough programs to fill the GPU even for one row, at least one BLOCK each
        seg = max(block, _pow2(cdiv(C * T, 512)))
    S = max(1, cdiv(C, seg))
    hist = torch.zeros((4, T, 256), dtype=torch.int32, device=logits.device)
    picks = torch.empty((4, T, 2), dtype=torch.int64, device=logits.device)
    segcount = torch.empty((T, S, 257), dtype=torch.int32, device=logits.device)
    for level in range(4):
        _split_hist_kernel[(T, S)](logits, lengths, hist, picks, segcount, logits.stride(0), C, seg, S, T, k,
                                   LEVEL=level, BLOCK=block, num_warps=SPLIT_WARPS)
    _split_write_kernel[(T, S)](logits, lengths, hist, picks, segcount, out, logits.stride(0), out.stride(0),
                                C, k, seg, S, T, SP=_pow2(S), BLOCK=block, BLOCK_K=min(1024, _pow2(k)),
                                num_warps=SPLIT_WARPS)
    return out


TOPK_METHODS = ("radix16", "hist", "split")


def fastest_topk_method(columns: int, rows: int = 1, on_gpu: bool = True) -> str:
    """Which top-k kernel for `rows` rows of `columns` logits: the one a cost model fitted to CUDA-graph times says
    is faster (H100, top-k 2048; v51 results/h100/bench/gpu/indexer.csv, refitted to v52's kernels; v63: hist's
    in-register row refitted to the H100s' and H200s' 12.8-13.2 us). "hist" runs one program per row: ~13 us for a
    row held in registers (up to HIST_WHOLE_ROW_MAX columns), else ~4.1 ns a column (24 us at least), x (1 + rows /
    400) while the rows fit the SMs (1.3x at 128 rows) and ~rows / 130 beyond, where they queue. "split" cuts each row
    over many programs: ~12 us of fixed cost (five dependent launches and a memset), ~80 ps a column of one row (its
    segments' atomics and counts) and ~27 ps a logit. So split for one row (or a few) of any length and for longer
    rows, hist for batches of 4k rows (from ~10 rows); past ~250 rows the two run within a few percent of each other.
    do_bench times, which charge split for its several launches, had put the boundary at 16k whatever the batch. The
    CPU interpreter runs the simplest kernel."""
    if not on_gpu:
        return "radix16"
    hist_us = ((13.0 if columns <= HIST_WHOLE_ROW_MAX else max(24.0, 4.1e-3 * columns))
               * max(1 + rows / 400, rows / 130))
    split_us = 12.0 + 8e-5 * columns + 2.7e-5 * rows * columns
    return "split" if split_us < hist_us else "hist"


def indexer_topk(logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, block: int | None = None, method: str = "radix16",
                 seg: int | None = None) -> torch.Tensor:
    """Top-k positions per row among columns < lengths[row]: int32 [T, k], ascending, -1 padded.

    method "radix16" (one program per row, 4-bit digits by comparison, 10 passes over the row), "hist"
    (one program per row, 8-bit digits with tl.histogram, 5 passes; rows of up to HIST_WHOLE_ROW_MAX columns
    are read once and kept in registers) or "split" (each row cut into
    segments of `seg` columns handled by separate programs, global histograms: for small batches);
    all exact and identical in output.

    logits [T, C] float32. Ties at the k-th score go to the lowest positions (see the tie rule in
    glm5lab.sparse.indexer_reference); -0.0 ties with +0.0. NaN has no place in the order of values: the digit
    passes give it the place of its bits, so a NaN with the sign bit clear ranks above +inf and one with it set
    below -inf (torch.topk ranks every NaN first). No check: finding one would cost a pass and a host sync."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise Glm5labError(f"logits must be float32 [rows, columns], got {logits.dtype} {tuple(logits.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise Glm5labError(f"k must be a positive int, got {k!r}")
    block = power_of_two("block", block, 16)
    if method not in TOPK_METHODS:
        raise Glm5labError(f"top-k method must be one of {TOPK_METHODS}, got {method!r}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    T, C = logits.shape
    if lengths is None:
        lengths = torch.full((T,), C, dtype=torch.int32, device=logits.device)
    lengths = index_vector("lengths", lengths, T)
    require_launch_device(logits=logits, lengths=lengths, out=out)
    if out is None:
        out = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    elif out.shape != (T, k) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise Glm5labError(f"out must be int32 [{T}, {k}] contiguous in its last dimension")
    if T == 0:
        return out
    if method == "split":
        return _topk_split(logits, k, lengths, out, block, seg)
    if method == "hist" and C <= HIST_WHOLE_ROW_MAX:
        row = _pow2(C, 16)
        _topk_hist_row_kernel[(T,)](logits, lengths, out, logits.stride(0), out.stride(0), C, k, ROW=row,
                                    BLOCK_K=min(1024, _pow2(k)), num_warps=HIST_ROW_WARPS)
        return out
    kernel = _topk_kernel if method == "radix16" else _topk_hist_kernel
    kernel[(T,)](logits, lengths, out, logits.stride(0), out.stride(0), C, k,
                 BLOCK=block or 1024, BLOCK_K=min(1024, _pow2(k)), num_warps=8)
    return out


def torch_topk(logits: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The same contract with torch.topk (the baseline the benchmark compares against); ties are
    resolved however torch.topk resolves them, which the tie rule allows. Order: by score."""
    T, C = logits.shape
    x = logits
    if lengths is not None:
        cols = torch.arange(C, device=logits.device)
        x = logits.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    take = min(k, C)
    idx = torch.topk(x, take, dim=1).indices
    out = torch.full((T, k), -1, dtype=torch.int32, device=logits.device)
    if lengths is not None:
        keep = torch.arange(take, device=logits.device)[None, :] < lengths[:, None]
        idx = torch.where(keep, idx, torch.full_like(idx, -1))
    out[:, :take] = idx.int()
    return out
