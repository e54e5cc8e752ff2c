"""Fused sparse MLA attention (absorbed / MQA form) in Triton: each token attends to its own top-k KV slots.

Why this shape of kernel (notebook 05 walks through it):
- One program owns ONE token and a tile of its heads (up to 64), so all heads of the token share a single
  pass over the token's KV rows: each gathered row is loaded once and used for Q.K^T (576 wide) and for
  P.V (its first 512 values).  128 heads run as two 64-head tiles whose programs are adjacent in the
  launch order, so the second tile reads the same rows mostly from L2.
- Rows are processed in 128-wide latent chunks (4 x 128 + 64 rope).  That is what makes the fp8_ds_mla
  layout cheap: each chunk has ONE float32 scale per row, so the scale multiplies the chunk's partial
  score (and the probabilities before P.V) instead of every fp8 value -- the fp8 -> bf16/fp16 cast is exact.
  At <= 16 heads (17-32 on SM90/SM100, v55) the fp8 latent products run in fp16 whatever q's dtype ("f16" path,
  NOTES.md v5): e4m3 -> fp16 is one instruction per two values, e4m3 -> bf16 three; q is scaled per head by a
  power of two into fp16's range and the probabilities are taken relative to the running largest scale, so
  nothing is lost.
  GPUs whose Triton has no float8e4nv (SM80/86, ROCm) run every fp8 tile that way, with a bit-level conversion.
- When tokens x head-tiles cannot fill the GPU (decode, small batches), the top-k list is split across
  programs; each writes a partial (normalized out, log2-sum-exp) and the partials are merged with the
  usual log-sum-exp rule by a second kernel that is parallel over heads AND output columns (each program
  loads many splits' partials at once), or (merge="fused") by the last program of each token to finish,
  found with an atomic counter -- one launch instead of two, but one program reads every partial.
  The 64-head Gluon kernels write their partials in fp16 (elsewhere fp32 unless _config={"partials": "fp16"};
  separate merge only), each head's 512 values scaled by a power of two into [2^14, 2^15) with the inverse kept
  beside its lse: half the bytes written and read back, at most 2^-11 of the head's largest value lost
  (`partial_scale_plane`), columns stored in the wgmma accumulator's order within 16-column blocks
  (`stored_column`).
- Slot -1 (anywhere in the row) and slots beyond the cache are skipped; a row with no valid slot gives
  out = 0 and lse = -inf, the convention of `glm5lab.sparse.reference.sparse_mla_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

from glm5lab.env import interpreter_mode as _interpreting
from glm5lab.errors import Glm5labError
from glm5lab.kernels.checks import require_finite_scale, require_launch_device
from glm5lab.kernels.f16_domain import e4m3_bits_to_f16_times_2e_8, pow2_into_f16_range
from glm5lab.kernels.fp8_ds_mla import ROW_BYTES as FP8_ROW_BYTES
from glm5lab.kernels.host import cdiv, cuda_capability, next_pow2, shared_memory_per_block, sm_count

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LATENT = 512
ROPE = 64
MAX_HEADS = 128
LAYOUTS = ("auto", "bf16", "fp16", "fp8_ds_mla")
CACHE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_ds_mla": torch.uint8}   # each layout's storage
# Private fp8_ds_mla code paths, chosen with _config={"fp8_path": ...} (NOTES.md "v4": the lead measures them
# beside the default before any becomes the default). Each maps to the kernel's (RELOAD, FP8_DIAG, WORDS).
#   "default": one read of each 128-value chunk feeds both Q.K^T and P.V. In the sm90 build of the <= 32-head
#              tiles (mma.sync) the pipeliner does not take a load with two uses: the chunk gathers stay
#              synchronous in the loop (the bf16 path's are cp.async stages).
#   "reload":  the same values and products as "default"; each chunk is read twice, once per product, so
#              every chunk load has one use and becomes a cp.async stage (DRAM bytes unchanged: the second
#              read hits L2).
#   "reload_words": "reload" whose P.V read takes the chunk as int32 words and splits the bytes with shifts
#              (same values, so the same results): the sm90 build then reaches the dot via ldmatrix.trans
#              instead of 256 one-byte LDS.U8 a step, and needs 198 registers instead of 255 + spills, but
#              161 KB of shared memory (one CTA per SM).
#   "f16" / "f16_reload" (v5): the fp16 compute domain. e4m3 -> fp16 is ONE conversion instruction per two
#              values (e4m3 -> bf16 takes three), so the latent half of Q.K^T and P.V run as fp16 dots: q's
#              latent part is scaled per head by a power of two into fp16's range (exact), the probabilities
#              enter P.V relative to the running largest chunk scale (p * s / r in [0, 1], rounded to fp16:
#              finer than bf16). The rope part stays a dot in q's dtype. On sm_89+ the conversion is an
#              opaque inline-PTX op, so Triton cannot move the layout change above it (the default path's
#              one-byte shared-memory reads); elsewhere, and in the interpreter, an exact bit-level conversion
#              (CVT_BITS). On GPUs without float8e4nv (SM80/86, ROCm) every fp8 tile runs this path.
# Each maps to the kernel's (RELOAD, FP8_DIAG, WORDS, F16).
FP8_PATHS = {"default": (False, 0, False, False), "reload": (True, 0, False, False),
             "reload_words": (True, 0, True, False), "f16": (False, 0, False, True),
             "f16_reload": (True, 0, False, True)}
# Timing diagnostics that place the fp8 time. They give WRONG results and need _config["_diagnostic"]=True;
# never exposed to users (the benchmark's fp8-v4 option uses them).
_FP8_DIAGNOSTICS = {"_diag_reload_no_scales": (True, 1, False, False),      # "reload" without scale loads/multiplies
                    "_diag_reload_no_convert": (True, 2, False, False)}     # ... and bytes -> 16 bits by a shift
# e4m3 x4 (one 32-bit register) -> fp16 x4 (two registers), the instruction pair Triton itself emits for
# float8e4nv -> float16 on sm89+; as a non-pure inline op it is a fence for Triton's layout propagation.
_E4M3X4_TO_F16X4 = tl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def _gather_chunk(base, row_stride, rows, valid, c: tl.constexpr, AGAIN: tl.constexpr):
    """The stored elements [128c, 128c + 128) of the gathered rows (0 for invalid rows). AGAIN marks the second
    read of the same bytes (an L1 hit; a different eviction hint keeps the compiler from merging the two)."""
    offs = c * 128 + tl.arange(0, 128)
    ptrs = base + rows[:, None] * row_stride + offs[None, :]
    if AGAIN:
        return tl.load(ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=valid[:, None], other=0)


@triton.jit
def _load_latent_chunk(base, row_stride, rows, valid, c: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr,
                       AGAIN: tl.constexpr = False, DIAG: tl.constexpr = 0):
    """[BLOCK_N, 128] latent values of chunk c of the gathered rows, in the compute dtype. DIAG 2 (timing
    diagnostic only, WRONG values): the fp8 bytes become 16-bit patterns by an integer shift instead of the
    e4m3 conversion."""
    x = _gather_chunk(base, row_stride, rows, valid, c, AGAIN)
    if FP8:
        if DIAG == 2:
            x = (x.to(tl.int16) << 4).to(DTYPE, bitcast=True)
        else:
            x = x.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    return x


@triton.jit
def _load_latent_chunk_words(base, row_stride, rows, valid, c: tl.constexpr, DTYPE: tl.constexpr):
    """Chunk c as _load_latent_chunk(FP8, AGAIN) returns it, read as 32 int32 words a row: the 4 bytes of
    each word are split with shifts, converted, and put back in memory order with join/permute/reshape
    (order-preserving by definition, unlike v3's packed PTX). Aim: no one-byte LDS.U8 reads for P.V."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    offs = c * 32 + tl.arange(0, 32)
    ptrs = (base + rows[:, None] * row_stride).to(tl.pointer_type(tl.int32)) + offs[None, :]
    w = tl.load(ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    b0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    b1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    b2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    b3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    x = tl.join(tl.join(b0, b1), tl.join(b2, b3))          # [BLOCK_N, 32, i, p]: byte 4w + 2p + i
    x = tl.permute(x, (0, 1, 3, 2))                          # [BLOCK_N, 32, p, i]
    return tl.reshape(x, (BLOCK_N, 128))


@triton.jit
def _load_scale(base, row_stride, rows, valid, c: tl.constexpr):
    """float32 scale of chunk c of each gathered fp8_ds_mla row (bytes 512 + 4c)."""
    ptrs = (base + rows * row_stride + 512 + 4 * c).to(tl.pointer_type(tl.float32))
    return tl.load(ptrs, mask=valid, other=0.0)


# How the "f16" paths turn e4m3 bytes into fp16 (constexpr CVT):
CVT_ASM = tl.constexpr(1)    # NVIDIA sm_89+: inline PTX cvt.rn.f16x2.e4m3x2 (one instruction per two values)
CVT_BITS = tl.constexpr(2)   # anywhere (SM80/86, ROCm, the interpreter): sign and the 7 exponent+mantissa bits moved into an fp16
               # pattern, which is the value times 2^-8 -- the 2^8 goes into the chunk scale, so it is exact


@triton.jit
def _load_chunk_f16(base, row_stride, rows, valid, c: tl.constexpr, CVT: tl.constexpr, AGAIN: tl.constexpr = False):
    """fp8 chunk c of the gathered rows as fp16 ("f16" paths): the e4m3 values themselves (CVT_ASM) or the values
    times 2^-8 (CVT_BITS; the caller scales by 2^8). The inline PTX is an opaque op, so Triton cannot move the
    layout change for the dots above it (which makes the default path read bytes one at a time)."""
    x = _gather_chunk(base, row_stride, rows, valid, c, AGAIN)
    if CVT == CVT_ASM:
        return tl.inline_asm_elementwise(_E4M3X4_TO_F16X4, "=r,=r,r", [x], dtype=tl.float16, is_pure=False,
                                         pack=4)
    return e4m3_bits_to_f16_times_2e_8(x)


@triton.jit
def _latent_chunks(KV, row_stride, rows, valid, FP8: tl.constexpr, DTYPE: tl.constexpr, F16: tl.constexpr,
                   CVT: tl.constexpr, AGAIN: tl.constexpr, WORDS: tl.constexpr, DIAG: tl.constexpr):
    """The 4 latent chunks of the gathered rows as the path reads them: fp16 ("f16" paths), int32 words (the
    second read of "reload_words"), or the compute dtype."""
    if FP8 and F16:
        k0 = _load_chunk_f16(KV, row_stride, rows, valid, 0, CVT, AGAIN)
        k1 = _load_chunk_f16(KV, row_stride, rows, valid, 1, CVT, AGAIN)
        k2 = _load_chunk_f16(KV, row_stride, rows, valid, 2, CVT, AGAIN)
        k3 = _load_chunk_f16(KV, row_stride, rows, valid, 3, CVT, AGAIN)
    elif WORDS:
        k0 = _load_latent_chunk_words(KV, row_stride, rows, valid, 0, DTYPE)
        k1 = _load_latent_chunk_words(KV, row_stride, rows, valid, 1, DTYPE)
        k2 = _load_latent_chunk_words(KV, row_stride, rows, valid, 2, DTYPE)
        k3 = _load_latent_chunk_words(KV, row_stride, rows, valid, 3, DTYPE)
    else:
        k0 = _load_latent_chunk(KV, row_stride, rows, valid, 0, FP8, DTYPE, AGAIN, DIAG)
        k1 = _load_latent_chunk(KV, row_stride, rows, valid, 1, FP8, DTYPE, AGAIN, DIAG)
        k2 = _load_latent_chunk(KV, row_stride, rows, valid, 2, FP8, DTYPE, AGAIN, DIAG)
        k3 = _load_latent_chunk(KV, row_stride, rows, valid, 3, FP8, DTYPE, AGAIN, DIAG)
    return k0, k1, k2, k3


@triton.jit
def partial_scale_plane(PART_LSE, num_splits, num_heads):
    """fp16 partials: where each partial's scale lives -- the second plane of PART_LSE [2, T, S, H] (the first holds
    the lse), so the default fp32 form keeps its arguments. T = the grid's second dimension in the attention
    kernels and in both merges. A head's stored values are o * 2^k, its scale 2^-k (exact)."""
    return PART_LSE + tl.num_programs(1).to(tl.int64) * num_splits * num_heads


@triton.jit
def stored_column(c):
    """fp16 partials: where true column c = 16 b + 8 g + 2 q + e is stored: 16 b + 4 q + 2 g + e. In the 64-head
    kernels' wgmma accumulator a thread holds columns 2q, 2q+1 of two 8-column groups g of a head row: stored so,
    its four fp16 values are 8 contiguous bytes and a quad of threads writes a whole 32-byte sector (in true order,
    4-byte stores: half a sector each; NOTES.md v14)."""
    return (c // 16) * 16 + ((c % 8) // 2) * 4 + ((c // 8) % 2) * 2 + c % 2


@triton.jit
def _pv_f16(p, s, v, acc, alpha, r_old):
    """(acc * alpha + (p * s) @ v) / r_new for the "f16" fp8 paths, r_new = max(r_old, this step's largest
    scale): the accumulator is kept in units of the running largest scale (like the running max of the
    online softmax), so p * s / r_new lies in [0, 1] for the fp16 dot and the rescale folds into alpha."""
    r_new = tl.maximum(r_old, tl.max(s, 0))
    pv = (p * (s / r_new)[None, :]).to(tl.float16)
    return tl.dot(pv, v, acc * (alpha * (r_old / r_new))[:, None]), r_new


@triton.jit
def _mm(a, b, acc, UPCAST: tl.constexpr):
    """a @ b + acc with fp32 accumulation.  UPCAST (interpreter + bf16 only): Triton 3.6's interpreter
    multiplies bf16 dot operands as raw bits, so operands go through float32 there -- the same products,
    since they were rounded to bf16 before."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _sparse_mla_fwd_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE, COUNTER,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, UPCAST: tl.constexpr, RELOAD: tl.constexpr = False,
    FP8_DIAG: tl.constexpr = 0, WORDS: tl.constexpr = False, F16: tl.constexpr = False,
    CVT: tl.constexpr = 1, S_PAD: tl.constexpr = 1, PDL: tl.constexpr = False, PART_F16: tl.constexpr = False,
):
    if PDL:
        # programmatic dependent launch (sm90+): the merge kernel may start its launch now; it waits in
        # gdc_wait until this grid has finished and its stores are visible
        gdc_launch_dependents()
    pid_h = tl.program_id(0)          # head tile: fastest-varying, so a token's tiles run side by side
    t = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    DTYPE = Q.dtype.element_ty

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    d128 = tl.arange(0, 128)
    q_rows = Q + t * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_rows + d128[None, :], mask=hmask[:, None], other=0)
    q1 = tl.load(q_rows + 128 + d128[None, :], mask=hmask[:, None], other=0)
    q2 = tl.load(q_rows + 256 + d128[None, :], mask=hmask[:, None], other=0)
    q3 = tl.load(q_rows + 384 + d128[None, :], mask=hmask[:, None], other=0)
    qr = tl.load(q_rows + 512 + tl.arange(0, 64)[None, :], mask=hmask[:, None], other=0)

    if FP8 and F16:
        # fp16 domain (fp8 path "f16"): q's latent part scaled per head by a power of two into fp16 range
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0.to(tl.float32)), 1), tl.max(tl.abs(q1.to(tl.float32)), 1)),
                          tl.maximum(tl.max(tl.abs(q2.to(tl.float32)), 1), tl.max(tl.abs(q3.to(tl.float32)), 1)))
        q_mul = pow2_into_f16_range(amax)
        q_unscale = 1.0 / q_mul                                        # exact: a power of two
        q0 = (q0.to(tl.float32) * q_mul[:, None]).to(tl.float16)
        q1 = (q1.to(tl.float32) * q_mul[:, None]).to(tl.float16)
        q2 = (q2.to(tl.float32) * q_mul[:, None]).to(tl.float16)
        q3 = (q3.to(tl.float32) * q_mul[:, None]).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)

    # f16 paths: accumulators in units of the running largest chunk scale (starts at the least normal fp32)
    r0 = 1.1754943508222875e-38
    r1 = 1.1754943508222875e-38
    r2 = 1.1754943508222875e-38
    r3 = 1.1754943508222875e-38

    n_start = s * rows_per_split
    n_end = tl.minimum(n_start + rows_per_split, topk)
    slot_row = SLOTS + t * stride_st
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_row + offs_n, mask=offs_n < n_end, other=-1)
        valid = (slot >= 0) & (slot < num_slots)
        rows = tl.where(valid, slot, 0).to(tl.int64)
        k0, k1, k2, k3 = _latent_chunks(KV, kv_row_stride, rows, valid, FP8, DTYPE, F16, CVT, False, False, FP8_DIAG)
        if FP8 and FP8_DIAG > 0:
            # timing diagnostics (never user-selectable): no scale loads, no scale multiplies -- the bf16
            # path's loop body on converted tiles; results are WRONG
            rope_ptrs = (KV + rows[:, None] * kv_row_stride + 528).to(tl.pointer_type(tl.bfloat16))
            kr = tl.load(rope_ptrs + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0).to(DTYPE)
            qk = _mm(q0, tl.trans(k0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST)
            qk = _mm(q1, tl.trans(k1), qk, UPCAST)
            qk = _mm(q2, tl.trans(k2), qk, UPCAST)
            qk = _mm(q3, tl.trans(k3), qk, UPCAST)
            qk = _mm(qr, tl.trans(kr), qk, UPCAST)
        elif FP8:
            rope_ptrs = (KV + rows[:, None] * kv_row_stride + 528).to(tl.pointer_type(tl.bfloat16))
            kr = tl.load(rope_ptrs + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0).to(DTYPE)
            s0 = _load_scale(KV, kv_row_stride, rows, valid, 0)
            s1 = _load_scale(KV, kv_row_stride, rows, valid, 1)
            s2 = _load_scale(KV, kv_row_stride, rows, valid, 2)
            s3 = _load_scale(KV, kv_row_stride, rows, valid, 3)
            if F16 and CVT == CVT_BITS:   # the tiles hold the values times 2^-8
                s0 = s0 * 256.0
                s1 = s1 * 256.0
                s2 = s2 * 256.0
                s3 = s3 * 256.0
            LAT_UPCAST: tl.constexpr = UPCAST and not F16       # the f16 paths' latent dots are fp16 x fp16
            zero = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            qk = _mm(q0, tl.trans(k0), zero, LAT_UPCAST) * s0[None, :]
            qk += _mm(q1, tl.trans(k1), zero, LAT_UPCAST) * s1[None, :]
            qk += _mm(q2, tl.trans(k2), zero, LAT_UPCAST) * s2[None, :]
            qk += _mm(q3, tl.trans(k3), zero, LAT_UPCAST) * s3[None, :]
            if F16:
                qk = qk * q_unscale[:, None]
            qk = _mm(qr, tl.trans(kr), qk, UPCAST)
        else:
            kr = tl.load(KV + rows[:, None] * kv_row_stride + 512 + tl.arange(0, 64)[None, :],
                         mask=valid[:, None], other=0)
            qk = _mm(q0, tl.trans(k0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST)
            qk = _mm(q1, tl.trans(k1), qk, UPCAST)
            qk = _mm(q2, tl.trans(k2), qk, UPCAST)
            qk = _mm(q3, tl.trans(k3), qk, UPCAST)
            qk = _mm(qr, tl.trans(kr), qk, UPCAST)
        qk = tl.where(valid[None, :], qk * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # all-masked so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8 and RELOAD:
            # fp8 "reload": read the chunks again for P.V instead of keeping 4 converted tiles live across
            # the softmax; the bytes come from L1/L2, DRAM traffic is unchanged. With one use per load the
            # pipeliner makes all eight chunk loads cp.async stages (sm90 build, NOTES.md v4).
            k0, k1, k2, k3 = _latent_chunks(KV, kv_row_stride, rows, valid, FP8, DTYPE, F16, CVT, True, WORDS, FP8_DIAG)
        if FP8 and F16:
            # P.V in fp16: p * s / r is in [0, 1] (fp16 keeps 11 bits there, bf16 8); r, the largest scale
            # of the chunk seen so far, comes back as a factor on the accumulator after the loop
            acc0, r0 = _pv_f16(p, s0, k0, acc0, alpha, r0)
            acc1, r1 = _pv_f16(p, s1, k1, acc1, alpha, r1)
            acc2, r2 = _pv_f16(p, s2, k2, acc2, alpha, r2)
            acc3, r3 = _pv_f16(p, s3, k3, acc3, alpha, r3)
        elif FP8 and FP8_DIAG == 0:
            acc0 = _mm((p * s0[None, :]).to(DTYPE), k0, acc0 * alpha[:, None], UPCAST)
            acc1 = _mm((p * s1[None, :]).to(DTYPE), k1, acc1 * alpha[:, None], UPCAST)
            acc2 = _mm((p * s2[None, :]).to(DTYPE), k2, acc2 * alpha[:, None], UPCAST)
            acc3 = _mm((p * s3[None, :]).to(DTYPE), k3, acc3 * alpha[:, None], UPCAST)
        else:
            pb = p.to(DTYPE)
            acc0 = _mm(pb, k0, acc0 * alpha[:, None], UPCAST)
            acc1 = _mm(pb, k1, acc1 * alpha[:, None], UPCAST)
            acc2 = _mm(pb, k2, acc2 * alpha[:, None], UPCAST)
            acc3 = _mm(pb, k3, acc3 * alpha[:, None], UPCAST)
        m_i = m_new

    if FP8 and F16:
        acc0 = acc0 * r0
        acc1 = acc1 * r1
        acc2 = acc2 * r2
        acc3 = acc3 * r3
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if SPLIT:
        # partial: PART_O [T, S, H, 512] fp32 (normalized), PART_LSE [T, S, H] (log2 domain)
        part = t * num_splits + s
        po = PART_O + (part * num_heads + heads[:, None]) * 512 + d128[None, :]
        if PART_F16:
            amax = tl.maximum(tl.maximum(tl.max(tl.abs(acc0), 1), tl.max(tl.abs(acc1), 1)),
                              tl.maximum(tl.max(tl.abs(acc2), 1), tl.max(tl.abs(acc3), 1))) * inv_l
            mul = pow2_into_f16_range(amax)
            inv_l = inv_l * mul
            tl.store(partial_scale_plane(PART_LSE, num_splits, num_heads) + part * num_heads + heads, 1.0 / mul,
                     mask=hmask)
            po = PART_O + (part * num_heads + heads[:, None]) * 512 + stored_column(d128)[None, :]
        tl.store(po, (acc0 * inv_l[:, None]).to(PART_O.dtype.element_ty), mask=hmask[:, None])
        tl.store(po + 128, (acc1 * inv_l[:, None]).to(PART_O.dtype.element_ty), mask=hmask[:, None])
        tl.store(po + 256, (acc2 * inv_l[:, None]).to(PART_O.dtype.element_ty), mask=hmask[:, None])
        tl.store(po + 384, (acc3 * inv_l[:, None]).to(PART_O.dtype.element_ty), mask=hmask[:, None])
        tl.store(PART_LSE + part * num_heads + heads, lse2, mask=hmask)
        if FUSED_MERGE:
            # The last program of this (token, head tile) to finish merges all partials: the barrier makes
            # every thread's stores precede the counter's release, the acq_rel atomic orders the loads.
            tl.debug_barrier()
            ticket = tl.atomic_add(COUNTER + t * tl.num_programs(0) + pid_h, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                _merge_partials(PART_O, PART_LSE, OUT, LSE, t, heads, hmask, num_splits, num_heads,
                                stride_ot, stride_oh, stride_lt, BLOCK_H, S_PAD)
                tl.atomic_xchg(COUNTER + t * tl.num_programs(0) + pid_h, 0)
    else:
        o = OUT + t * stride_ot + heads[:, None] * stride_oh + d128[None, :]
        tl.store(o, (acc0 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
        tl.store(o + 128, (acc1 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
        tl.store(o + 256, (acc2 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
        tl.store(o + 384, (acc3 * inv_l[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
        tl.store(LSE + t * stride_lt + heads, lse2 * 0.6931471805599453, mask=hmask)


@triton.jit
def _split_lse_max_and_weight(PART_LSE, part0, num_splits, num_heads, heads, hmask, S_PAD: tl.constexpr):
    """Per head over a token's splits (partials part0 .. part0 + num_splits - 1): the largest log2-sum-exp
    (0 where every split is empty, so exp2 stays finite) and the total weight sum_s 2^(lse_s - max), every
    split's lse in ONE load (S_PAD >= num_splits)."""
    sidx = tl.arange(0, S_PAD)
    ls_all = tl.load(PART_LSE + (part0 + sidx[:, None]) * num_heads + heads[None, :],
                     mask=(sidx[:, None] < num_splits) & hmask[None, :], other=float("-inf"), cache_modifier=".cg")
    m = tl.max(ls_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m_safe, tl.sum(tl.exp2(ls_all - m_safe[None, :]), 0)


@triton.jit
def _merged_scale_and_lse(m_safe, wsum):
    """(1 / total weight, natural-log lse) of merged partials; a head with no valid slot in any split gets
    0 (so out = 0) and lse = -inf."""
    empty = wsum == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, wsum))
    lse = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, wsum))) * 0.6931471805599453)
    return inv, lse


@triton.jit
def _merge_partials(PART_O, PART_LSE, OUT, LSE, t, heads, hmask, num_splits, num_heads,
                    stride_ot, stride_oh, stride_lt, BLOCK_H: tl.constexpr, S_PAD: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse); lse = max + log2(sum w) (-> ln).
    Latency-bound (one program reads splits x heads x 2 KB from L2 while the GPU idles), so: every split's
    lse in one load (S_PAD >= num_splits), and (16-head tiles) split s+1's partial is loaded before split
    s is added."""
    d128 = tl.arange(0, 128)
    m_safe, wsum = _split_lse_max_and_weight(PART_LSE, t * num_splits, num_splits, num_heads, heads, hmask, S_PAD)
    o0 = tl.zeros([BLOCK_H, 128], tl.float32)
    o1 = tl.zeros([BLOCK_H, 128], tl.float32)
    o2 = tl.zeros([BLOCK_H, 128], tl.float32)
    o3 = tl.zeros([BLOCK_H, 128], tl.float32)
    hm = hmask[:, None]
    part0 = t * num_splits
    po = PART_O + (part0 * num_heads + heads[:, None]) * 512 + d128[None, :]
    step = num_heads * 512
    if BLOCK_H <= 16:
        # prefetch one split ahead (at 32/64-head tiles the second set of tiles spills: sm90 build)
        n0 = tl.load(po, mask=hm, other=0.0, cache_modifier=".cg")
        n1 = tl.load(po + 128, mask=hm, other=0.0, cache_modifier=".cg")
        n2 = tl.load(po + 256, mask=hm, other=0.0, cache_modifier=".cg")
        n3 = tl.load(po + 384, mask=hm, other=0.0, cache_modifier=".cg")
        nl = tl.load(PART_LSE + part0 * num_heads + heads, mask=hmask, other=float("-inf"), cache_modifier=".cg")
        for s in range(0, num_splits):
            c0, c1, c2, c3, cl = n0, n1, n2, n3, nl
            more = s + 1 < num_splits
            nb = po + (s + 1) * step
            n0 = tl.load(nb, mask=hm & more, other=0.0, cache_modifier=".cg")
            n1 = tl.load(nb + 128, mask=hm & more, other=0.0, cache_modifier=".cg")
            n2 = tl.load(nb + 256, mask=hm & more, other=0.0, cache_modifier=".cg")
            n3 = tl.load(nb + 384, mask=hm & more, other=0.0, cache_modifier=".cg")
            nl = tl.load(PART_LSE + (part0 + s + 1) * num_heads + heads, mask=hmask & more, other=float("-inf"),
                         cache_modifier=".cg")
            w = tl.exp2(cl - m_safe)
            o0 += w[:, None] * c0
            o1 += w[:, None] * c1
            o2 += w[:, None] * c2
            o3 += w[:, None] * c3
    else:
        for s in range(0, num_splits):
            pb = po + s * step
            w = tl.exp2(tl.load(PART_LSE + (part0 + s) * num_heads + heads, mask=hmask, other=float("-inf"),
                                cache_modifier=".cg") - m_safe)
            o0 += w[:, None] * tl.load(pb, mask=hm, other=0.0, cache_modifier=".cg")
            o1 += w[:, None] * tl.load(pb + 128, mask=hm, other=0.0, cache_modifier=".cg")
            o2 += w[:, None] * tl.load(pb + 256, mask=hm, other=0.0, cache_modifier=".cg")
            o3 += w[:, None] * tl.load(pb + 384, mask=hm, other=0.0, cache_modifier=".cg")
    inv, lse = _merged_scale_and_lse(m_safe, wsum)
    o = OUT + t * stride_ot + heads[:, None] * stride_oh + d128[None, :]
    tl.store(o, (o0 * inv[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
    tl.store(o + 128, (o1 * inv[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
    tl.store(o + 256, (o2 * inv[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
    tl.store(o + 384, (o3 * inv[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
    tl.store(LSE + t * stride_lt + heads, lse, mask=hmask)


# Phase stamps, a diagnostic (`latency_anatomy --phases`, NOTES.md v27): a kernel given STAMPS (int64, STAMP_SLOTS
# values a program) writes them -- the 1-3 token fp8 Gluon kernel the SM's clock64 at its phase boundaries and
# globaltimer (ns, one clock for every SM) at its start and end (`sparse_mla_sm90.PHASES`), each separate-merge program
# globaltimer at its start, once it may read the partials and after its stores -- so that the time inside one program
# and between the grids can be placed. Off (STAMPS None), the kernels build as before.
STAMP_SLOTS = tl.constexpr(16)


def check_stamps(buf, programs: int, what: str) -> None:
    """Refuse a phase-stamp buffer that is not int64 on the GPU or holds fewer than programs x STAMP_SLOTS values."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int64:
        raise Glm5labError(f"phase stamps of {what}: an int64 tensor, got {getattr(buf, 'dtype', type(buf).__name__)}")
    if buf.numel() < programs * STAMP_SLOTS.value:
        raise Glm5labError(f"phase stamps of {what}: the buffer holds {buf.numel()} values, fewer than its {programs} "
                           f"programs x {STAMP_SLOTS.value}")


@triton.jit
def _stamp_global(STAMPS, prog, k: tl.constexpr):
    """Stamp k of program prog: globaltimer now, in program order (after the instructions issued before it: a warp
    issues in order, so after whatever their operands waited for)."""
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(STAMPS + prog * STAMP_SLOTS + k, now)


@triton.jit
def _merge_prog():
    """A separate-merge program's index in its grid (head tile, token, column block), for its stamps."""
    return (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def _merge_program(num_splits, num_heads, MH: tl.constexpr, DC: tl.constexpr, PDL: tl.constexpr, STAMPS=None):
    """What a separate-merge program (head tile, token, column block) covers: (token, column block, its heads, their
    mask, its columns, the token's first partial). STAMPS: globaltimer at its start (stamp 0) and once it may read
    the partials (1)."""
    if STAMPS is not None:
        _stamp_global(STAMPS, _merge_prog(), 0)
    if PDL:
        gdc_wait()        # launched early (programmatic dependent launch): wait for the attention grid
    if STAMPS is not None:
        _stamp_global(STAMPS, _merge_prog(), 1)
    t = tl.program_id(1).to(tl.int64)
    pid_d = tl.program_id(2)
    heads = tl.program_id(0) * MH + tl.arange(0, MH)
    return t, pid_d, heads, heads < num_heads, pid_d * DC + tl.arange(0, DC), t * num_splits


@triton.jit
def _store_merged(OUT, LSE, acc, m_safe, wsum, t, pid_d, heads, hmask, cols, stride_ot, stride_oh, stride_lt,
                  PART_F16: tl.constexpr, STAMPS=None):
    """A separate-merge program's output block (acc / total weight) and, from its first column block, the lse.
    fp16 partials: cols are stored columns (whole 16-column blocks); the values are put back in true column order
    in registers (stored 16 b + 4 q + 2 g + e -> true 16 b + 8 g + 2 q + e), so the store stays contiguous."""
    inv, lse = _merged_scale_and_lse(m_safe, wsum)
    o = (acc * inv[:, None]).to(OUT.dtype.element_ty)
    if PART_F16:
        o = tl.reshape(tl.permute(tl.reshape(o, [o.shape[0], o.shape[1] // 16, 4, 2, 2]), [0, 1, 3, 2, 4]), o.shape)
    o_ptr = OUT + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
    tl.store(o_ptr, o, mask=hmask[:, None])
    if pid_d == 0:
        tl.store(LSE + t * stride_lt + heads, lse, mask=hmask)
    if STAMPS is not None:
        _stamp_global(STAMPS, _merge_prog(), 2)     # its stores issued


@triton.jit
def _times_partial_scale(w, PART_LSE, rows, mask, num_splits, num_heads, PART_F16: tl.constexpr):
    """A split's merge weight times its partials' scale (fp16 partials; fp32 ones have none)."""
    if PART_F16:
        w = w * tl.load(partial_scale_plane(PART_LSE, num_splits, num_heads) + rows, mask=mask, other=0.0,
                        cache_modifier=".cg")
    return w


@triton.jit
def _merge_columns_kernel(PART_O, PART_LSE, OUT, LSE, num_splits, num_heads, stride_ot, stride_oh, stride_lt,
                          MH: tl.constexpr, DC: tl.constexpr, SC: tl.constexpr, S_PAD: tl.constexpr,
                          PDL: tl.constexpr = False, PART_F16: tl.constexpr = False, STAMPS=None):
    """The separate merge, parallel over columns: program (head tile, token, column block) merges DC of the
    512 output columns of MH heads, reading SC splits' partials in ONE load each round (all in flight at
    once). One program doing all columns (the fused merge) reads splits x heads x 2 KB one split at a time:
    at 1-8 tokens that serial chain, not the attention, was most of the time (NOTES.md v6). When one round
    holds every split, the partials and the lse are loaded together: a single memory round trip."""
    t, pid_d, heads, hmask, cols, part0 = _merge_program(num_splits, num_heads, MH, DC, PDL, STAMPS)
    if SC >= S_PAD:
        sidx = tl.arange(0, S_PAD)
        smask = (sidx[:, None] < num_splits) & hmask[None, :]                             # [S_PAD, MH]
        po = PART_O + ((part0 + sidx[:, None, None]) * num_heads + heads[None, :, None]) * 512 + cols[None, None, :]
        o = tl.load(po, mask=smask[:, :, None], other=0.0, cache_modifier=".cg")         # [S_PAD, MH, DC]
        rows = (part0 + sidx[:, None]) * num_heads + heads[None, :]
        ls = tl.load(PART_LSE + rows, mask=smask, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(ls, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(ls - m_safe[None, :])
        wsum = tl.sum(w, 0)
        w = _times_partial_scale(w, PART_LSE, rows, smask, num_splits, num_heads, PART_F16)
        acc = tl.sum(w[:, :, None] * o.to(tl.float32), 0)
    else:
        m_safe, wsum = _split_lse_max_and_weight(PART_LSE, part0, num_splits, num_heads, heads, hmask, S_PAD)
        acc = tl.zeros([MH, DC], tl.float32)
        for s0 in range(0, num_splits, SC):
            sc = s0 + tl.arange(0, SC)
            smask = (sc[:, None] < num_splits) & hmask[None, :]                           # [SC, MH]
            rows = (part0 + sc[:, None]) * num_heads + heads[None, :]
            ls = tl.load(PART_LSE + rows, mask=smask, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(ls - m_safe[None, :])                                             # [SC, MH]
            w = _times_partial_scale(w, PART_LSE, rows, smask, num_splits, num_heads, PART_F16)
            po = PART_O + ((part0 + sc[:, None, None]) * num_heads + heads[None, :, None]) * 512 + cols[None, None, :]
            o = tl.load(po, mask=smask[:, :, None], other=0.0, cache_modifier=".cg")     # [SC, MH, DC]
            acc += tl.sum(w[:, :, None] * o.to(tl.float32), 0)
    _store_merged(OUT, LSE, acc, m_safe, wsum, t, pid_d, heads, hmask, cols, stride_ot, stride_oh, stride_lt,
                  PART_F16, STAMPS)


@triton.jit
def _merge_unrolled_kernel(PART_O, PART_LSE, OUT, LSE, num_splits, num_heads, stride_ot, stride_oh, stride_lt,
                           MH: tl.constexpr, DC: tl.constexpr, SC: tl.constexpr, S_PAD: tl.constexpr,
                           PDL: tl.constexpr = False, PART_F16: tl.constexpr = False, STAMPS=None):
    """The column-parallel merge with the splits unrolled: each round issues SC [MH, DC] loads (all in flight at
    once) and every thread sums its own elements over the splits -- no reduction across threads, so no shared
    memory round trip (the [splits, MH, DC] form reduces over a dimension spread across threads)."""
    t, pid_d, heads, hmask, cols, part0 = _merge_program(num_splits, num_heads, MH, DC, PDL, STAMPS)
    m_safe, wsum = _split_lse_max_and_weight(PART_LSE, part0, num_splits, num_heads, heads, hmask, S_PAD)
    acc = tl.zeros([MH, DC], tl.float32)
    for s0 in range(0, num_splits, SC):
        for i in tl.static_range(SC):
            ok = hmask & (s0 + i < num_splits)
            row = (part0 + s0 + i) * num_heads + heads
            ls = tl.load(PART_LSE + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(PART_O + row[:, None] * 512 + cols[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
            w = _times_partial_scale(tl.exp2(ls - m_safe), PART_LSE, row, ok, num_splits, num_heads, PART_F16)
            acc += w[:, None] * o.to(tl.float32)
    _store_merged(OUT, LSE, acc, m_safe, wsum, t, pid_d, heads, hmask, cols, stride_ot, stride_oh, stride_lt,
                  PART_F16, STAMPS)


# The column merge at <= NARROW_MERGE_MAX_HEADS heads: programs of 2 heads x MERGE_VALUES_PER_WARP values a round on one
# warp, not one 16-head x 8192-value program on four. Those calls are 1-8 tokens, so the wide tile left most SMs idle
# (1 token x 8 heads: 32 programs loading 32 KB each). H200, partials L2-warm (NOTES.md v24, merge_probe --columns),
# us: 8 heads x 1 / 2 / 8 tokens 2.70 / 2.75 / 3.15 -> 1.85 / 1.88 / 1.76; 16 heads 3.71 / 3.72 / 3.86 -> 1.79 /
# 1.87 / 1.99. The whole call (v24 call 5, the old tile beside the new in one sweep), fp8_ds_mla at 1 / 2 / 4 / 8
# tokens: 8 heads 8.42 / 8.99 / 10.77 / 13.40 -> 7.59 / 8.26 / 9.97 / 11.96 us, 16 heads 11.01 / 11.53 / 12.35 / 14.40
# -> 9.29 / 9.74 / 10.52 / 12.58 (bf16 alike).
# Beyond 16 heads, the 64-head kernels' fp16 partials (1-4 tokens, 32 splits): ONE head x MERGE_VALUES_PER_WARP values
# a round on one warp (64 columns = 128 contiguous bytes a split), not the wide 16-head tile. H200, merge_probe
# --columns (NOTES.md v27), us: 64 heads x 1 / 2 / 4 tokens 3.90 / 4.89 / 7.82 -> 2.48 / 3.21 / 4.03; 128 heads x
# 1 / 2 tokens 4.79 / 7.80 -> 3.33 / 3.95 (the <= 16-head rule's 2 heads x 32 columns: 2.64 / 3.44 / 4.79, 3.26 /
# 4.48; at 128 heads x 1 token 2 heads x 64 columns on 2 warps was best, 3.20). fp32 partials beyond 16 heads (the
# Triton kernel's) keep the wide tile: not measured.
NARROW_MERGE_MAX_HEADS = 16
MERGE_VALUES_PER_WARP = 2048


def merge_tiles(num_heads: int, num_splits: int, fp16: bool = False) -> tuple[int, int, int]:
    """(MH heads, DC columns, SC splits a round) of the column-parallel merge, the columns narrowed first so that many
    splits load at once: at <= NARROW_MERGE_MAX_HEADS heads 2 heads and MERGE_VALUES_PER_WARP fp32 values a round
    (one warp, `merge_warps`); beyond, fp16 partials (fp16) one head and MERGE_VALUES_PER_WARP values, fp32 ones at
    most 8192 values a round (64 registers a thread at 4 warps). DC >= 16: fp16 partials are stored in 16-column
    blocks."""
    s_pad = next_pow2(max(num_splits, 1))
    if num_heads > NARROW_MERGE_MAX_HEADS and fp16:
        dc = max(16, min(64, MERGE_VALUES_PER_WARP // s_pad))
        return 1, dc, max(1, min(s_pad, MERGE_VALUES_PER_WARP // dc))
    if num_heads <= NARROW_MERGE_MAX_HEADS:
        mh = min(2, next_pow2(num_heads))
        dc = max(16, min(64, MERGE_VALUES_PER_WARP // (s_pad * mh)))
        return mh, dc, max(1, min(s_pad, MERGE_VALUES_PER_WARP // (mh * dc)))
    mh = min(16, next_pow2(num_heads))
    dc = max(16, min(128, 8192 // (s_pad * mh)))
    sc = max(1, min(s_pad, 8192 // (mh * dc)))
    return mh, dc, sc


def merge_warps(kernel, mh: int, dc: int, sc: int) -> int:
    """Warps of a separate merge program: the column merge one per MERGE_VALUES_PER_WARP values a round (1-4), the
    unrolled merge 4."""
    if kernel is _merge_columns_kernel:
        return max(1, min(4, mh * dc * sc // MERGE_VALUES_PER_WARP))
    return 4


# Which separate merge a call runs. H200, CUDA-graph time with the partials L2-warm (NOTES.md v13,
# results/kernels/merge_probe_h200.csv): the unrolled merge at 8 x 64 tiles is 2-5x faster wherever there are
# few splits (64 heads x 32 tokens x 4 splits 23.1 -> 4.3 us, 8 heads 4.5 -> 2.3), and at 16 splits of >= 32
# heads (64 heads x 8 tokens 9.3 -> 4.9 us); with more splits, or 16 splits of <= 16 heads, the column merge,
# which loads every split at once over narrow columns, is faster (1 token x 32 splits 3.8 against 7.2 us).
UNROLLED_MERGE_MAX_SPLITS = 16


# fp16 partials at <= 4 splits: the unrolled merge with 256 columns a program. H200, partials L2-warm (NOTES.md v14
# runs 2-3, merge_probe_h200.csv), 64 heads x 64 tokens x 2 splits: 64 columns 5.9 us, 128 4.3, 256 3.8 (fp32
# partials at 64: 5.1-5.2); 32 tokens x 4 splits: 4.7, 3.8, 3.4 (fp32 4.3). At 16 splits wider is slower (128
# columns 7.5 against 5.4 us).
F16_WIDE_MERGE_MAX_SPLITS = 4


def merge_plan(num_heads: int, num_splits: int, fp16: bool = False):
    """(kernel, MH, DC, SC) of the separate merge of num_splits partials of num_heads heads (fp16: fp16 partials)."""
    if num_splits > UNROLLED_MERGE_MAX_SPLITS or (num_splits > 8 and num_heads <= 16):
        return (_merge_columns_kernel, *merge_tiles(num_heads, num_splits, fp16))
    s_pad = next_pow2(max(num_splits, 1))
    dc = 256 if fp16 and num_splits <= F16_WIDE_MERGE_MAX_SPLITS else 64
    return _merge_unrolled_kernel, min(8, next_pow2(num_heads)), dc, min(s_pad, 4 if s_pad <= 4 else 8)


def launch_merge(kernel, mh: int, dc: int, sc: int, part_o, part_lse, out, lse, pdl: bool = False,
                 num_warps: int | None = None, stamps=None) -> None:
    """One launch of a separate merge kernel (merge_plan's, or either by name) over partials [T, splits, H, 512] /
    [T, splits, H] into out [T, H, 512] and lse [T, H]; pdl: launched early (programmatic dependent launch);
    num_warps: `merge_warps` unless given; stamps: int64 [programs, STAMP_SLOTS] for the phase stamps (a diagnostic).
    fp16 partials come with part_lse [2, T, splits, H] (lse, then each partial's scale: `partial_scale_plane`)."""
    T, num_splits, H, _ = part_o.shape
    if stamps is not None:
        check_stamps(stamps, cdiv(H, mh) * T * (LATENT // dc), "the merge")
    f16 = part_o.dtype == torch.float16
    want = ((2,) if f16 else ()) + (T, num_splits, H)
    if tuple(part_lse.shape) != want:
        raise Glm5labError(f"{part_o.dtype} partials {tuple(part_o.shape)} need part_lse of shape {want}, "
                           f"got {tuple(part_lse.shape)}")
    kernel[(cdiv(H, mh), T, LATENT // dc)](
        part_o, part_lse, out, lse, num_splits, H, out.stride(0), out.stride(1), lse.stride(0),
        MH=mh, DC=dc, SC=sc, S_PAD=next_pow2(num_splits), PDL=pdl, PART_F16=f16, STAMPS=stamps,
        num_warps=num_warps or merge_warps(kernel, mh, dc, min(sc, next_pow2(num_splits))),
        **({"launch_pdl": True} if pdl else {}))


# ----------------------------------------------------------------------------------------------------
# host side

_COUNTERS: dict = {}
_RETIRED_COUNTERS: list = []
_STAGES: dict = {}


def _stage_ladder(key, stages: int):
    """Pipeline depths to try, the one that compiled last time first."""
    if key in _STAGES:
        return [_STAGES[key]]
    return list(range(stages, 0, -1))


def _register_cap(cfg: dict) -> dict:
    """{"maxnreg": n} when the config caps registers a thread (more CTAs a SM: 168 lets three 4-warp CTAs share
    an SM's 64K registers); nothing under the interpreter, which has no registers."""
    return {"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") and not _interpreting() else {}


def _nvidia_sm_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """A compiled (not interpreted) launch on an NVIDIA GPU of at least this compute capability."""
    if _interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return cuda_capability(device) >= capability


def _native_e4m3(device: torch.device) -> bool:
    """Whether Triton's float8e4nv and the PTX e4m3 conversion exist here: NVIDIA sm_89+ (and the interpreter,
    for Triton's cast). SM80/86 and ROCm have neither (Triton 3.6: "type fp8e4nv not supported in this
    architecture"): there fp8_ds_mla runs the "f16" path with the bit-level conversion."""
    return _interpreting() or _nvidia_sm_at_least(device, (8, 9))


def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (the merge kernel launched while the attention grid still runs, waiting
    in griddepcontrol.wait): NVIDIA sm_90+, not under the interpreter (which has no inline PTX)."""
    return _nvidia_sm_at_least(device, (9, 0))


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused merge; every launch leaves them zero again, so one buffer per
    device is reused (not safe for concurrent launches on two streams of one device). A buffer that is
    outgrown is kept alive, never freed: a CUDA graph captured earlier still points at it."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
        _RETIRED_COUNTERS.append(buf)
    return buf


# Shared memory (bytes) of the bf16/fp16 64-head tile by rows a step, at 2 stages (1 stage: within 256 B): 64 heads'
# q alone is 72 KB. From offline sm_120 builds (Triton 3.6, scripts/launch_build.py; sm_86 alike). On a ~100 KB GPU
# only 16 rows fit: the 64 x 64 tile made every > 32-head bf16/fp16 call there fail (NOTES.md v53).
WIDE_BF16_TILE_SHARED_MEMORY = {64: 155904, 32: 114816, 16: 94272}
# Shared memory (bytes) of the fp8 "f16" path on the 32 x 32 tile (offline sm_90 / sm_100 / sm_120 builds alike), the
# "default" path's 32 x 32 needing 49,792: fp8 at 17-32 heads takes "f16" where two such CTAs fit an SM, as the
# 32-head split count assumes (`resident_ctas`).
F16_32_HEAD_TILE_SHARED_MEMORY = 93312


def default_config(num_heads: int, fp8: bool, device=None) -> dict:
    """The Triton kernel's tile for this device (`default_config_for` its compute capability; None: CPU, the
    interpreter, ROCm)."""
    return default_config_for(num_heads, fp8, _compiled_capability(device) if device is not None else None)


def default_config_for(num_heads: int, fp8: bool, capability: tuple[int, int] | None) -> dict:
    """Tiles by head count and layout: BLOCK_H is the head tile (tl.dot needs >= 16 rows), BLOCK_N rows
    per step. Chosen from sm90 builds (register/spill/shared-memory report) and the H200 runs (NOTES.md):
    bf16 at > 32 heads takes BLOCK_N 64 (wgmma N=64; 221 KB shared, no spills); fp8 at <= 16 heads runs the
    fp16-domain path on 16x32 tiles (74 KB of shared memory; ~250 registers a thread: two CTAs a SM), and at 17-32
    heads on 32x32 tiles where two of those (93 KB each) fit an SM. On a GPU with
    ~100 KB of shared memory a block (SM86/89/120) bf16/fp16 at > 32 heads steps 16 rows; on SM100/103 it takes
    32-head tiles (the 64-head ones build into a trap there). capability: (major, minor) of a compiled NVIDIA
    launch, None for none -- so a GPU's tile can be asked for, and run, on another (the benchmark's other-GPU tiles)."""
    if num_heads <= 16:
        if fp8:
            # v5 (H200 run of 2026-11-29 12:35 UTC, results/kernels/kernel_bench_h200_v5.csv.gz): "f16" on 16x32
            # tiles 1.27-1.30x the v4 default ("reload", 16x64) at 128-512 tokens, 1.08-1.14x at 1-8 tokens;
            # the 16x64 f16 tile needs 129 KB of shared memory (one CTA a SM) and was slower than "reload".
            return {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2, "fp8_path": "f16"}
        return {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}
    if num_heads <= 32:
        smem = shared_memory_per_block(capability)
        if fp8 and smem is not None and smem >= 2 * F16_32_HEAD_TILE_SHARED_MEMORY:
            # v55 (H100, CUDA graphs, 5 interleaved rounds, 24 / 32 heads): "f16" 1.12-1.17x the "default" path at
            # 1-8 tokens, 1.42-1.58x at 32-512 (that path converts e4m3 -> bf16 with an F2F a value, reads bytes one
            # at a time and spills). SM90 / SM100 fit two CTAs of it; on ~100 KB GPUs (SM89 / SM120) it would run
            # one CTA an SM where "default" runs two: not measured there, so they keep "default".
            return {"block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 2, "fp8_path": "f16"}
        return {"block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if fp8:
        # the 64-head f16 tile spills (272 B) and measured 0.63-0.83x the "default" path: kept "default"
        return {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2}
    if capability is not None and capability[0] == 10:
        # datacenter Blackwell: Triton 3.6 builds every 64-head bf16/fp16 tile into a bare trap (its tensor-memory
        # accumulators do not fit the SM's; NOTES.md v53), so the 32-head tile, each KV row read once per 32 heads
        return {"block_h": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}
    smem = shared_memory_per_block(capability)
    if smem is not None and smem < WIDE_BF16_TILE_SHARED_MEMORY[64]:
        # ~100 KB GPUs (SM86/89/120): the largest 64-head tile that fits, single- or double-buffered alike
        return {"block_h": 64, "block_n": max(n for n, need in WIDE_BF16_TILE_SHARED_MEMORY.items() if need <= smem),
                "num_warps": 8, "num_stages": 2}
    return {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}


# merge="auto": the fused merge (one launch) up to this many splits, the column-parallel kernel beyond (H200,
# NOTES.md v6: fused 91-95 us vs 97-102 us at 8-16 heads x 128 tokens (2 splits), 68.7 vs 75.8 us at 64 heads x
# 32 tokens (4 splits); separate 35.9 vs 37.5 us at 8 heads x 32 tokens (8 splits), 2-4x faster at 16-64 splits)
FUSED_MERGE_MAX_SPLITS = 4


def resident_ctas(block_h: int) -> int:
    """CTAs of one tile that run side by side on an SM (sm90 builds: the 4-warp 16/32-head tiles use ~255
    registers a thread, so two; the 64-head tiles one -- 221 KB of shared memory in bf16, 8 warps x 255
    registers in fp8). The split count aims at filling every such slot: a program's
    step is a latency chain, so more programs in flight, not fewer longer ones, is what shortens a small batch."""
    return 2 if block_h <= 32 else 1


def choose_num_splits(num_tokens: int, head_tiles: int, topk: int, block_n: int, num_sms: int,
                      resident: int = 2) -> int:
    """As many splits of the top-k as fill num_sms x resident program slots, at most one step (block_n rows)
    a split; none when tokens x head tiles fill half the slots already. With the column-parallel merge a
    split costs little (H200 sweep, NOTES.md v6: 1 token x 8 heads fp8 9.9 us with 64 splits of 32 rows,
    23.2 us with the earlier 16 splits and the one-program merge)."""
    want = splits_wanted(num_tokens, head_tiles, num_sms, resident)
    if want < 2:
        return 1
    return int(max(1, min(want, topk // block_n)))


def splits_wanted(num_tokens: int, head_tiles: int, num_sms: int, resident: int = 2) -> int:
    """How many splits of the top-k would fill num_sms x resident program slots (`choose_num_splits`, before the
    top-k's own bound); under 2: the call is not split."""
    return (num_sms * resident) // max(num_tokens * head_tiles, 1)


def gluon_unavailable(num_heads: int, fp8: bool, q_dtype: torch.dtype, capability: tuple[int, int] | None,
                      kv_cache: torch.Tensor | None = None) -> str | None:
    """Why the Gluon kernels (sparse_mla_sm90) cannot run a call (None when they can): <= 128 heads, bf16 q with an
    fp8_ds_mla cache (bf16/fp16 caches: q of the cache's dtype, checked by sparse_mla_attention), a compiled launch
    on an NVIDIA sm_90 GPU -- the only one they were checked on -- and, when kv_cache is given, a cache whose rows
    start on 16-byte boundaries (their cp.async copies 16-byte pieces). capability: the GPU's (major, minor), None
    for no compiled NVIDIA launch (CPU, the interpreter, ROCm). 17-128 heads run the 64-head wgmma kernels."""
    if kv_cache is not None:
        row_bytes = _kv_rows(kv_cache)[1] * kv_cache.element_size()
        if kv_cache.data_ptr() % 16 or row_bytes % 16:
            return ("the Gluon kernels copy the cache rows in 16-byte pieces: the cache must start on a 16-byte "
                    f"boundary and its rows be a multiple of 16 bytes apart, got address % 16 = "
                    f"{kv_cache.data_ptr() % 16} and rows {row_bytes} bytes apart")
    if num_heads > 128:
        return f"the Gluon kernels run <= 128 heads, got {num_heads}"
    if fp8 and q_dtype != torch.bfloat16:
        return f"the Gluon fp8_ds_mla kernel takes bf16 q, got {q_dtype}"
    if capability is None:
        return "the Gluon kernel needs a compiled launch on an NVIDIA GPU (no interpreter runs Gluon)"
    if capability[0] != 9:
        return "the Gluon kernel was built and checked for sm_90 (Hopper) only"
    return None


def _require_call(num_heads: int, q_dtype: torch.dtype, layout: str, merge: str) -> None:
    """What sparse_mla_attention refuses of a call's heads, dtypes and merge, so that kernel_for never names a
    kernel for a call that would be refused (one wording for both)."""
    if q_dtype not in (torch.float16, torch.bfloat16):
        raise Glm5labError(f"q must be float16 or bfloat16, got {q_dtype}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or not 1 <= num_heads <= MAX_HEADS:
        raise Glm5labError(f"head count must be 1..{MAX_HEADS}, got {num_heads!r}")
    if layout != "fp8_ds_mla" and CACHE_DTYPE[layout] != q_dtype:
        raise Glm5labError(f"q ({q_dtype}) and a {layout} KV cache must have the same dtype")
    if merge not in ("auto", "fused", "separate"):
        raise Glm5labError(f"merge must be 'auto', 'fused' or 'separate', got {merge!r}")


def kernel_for(num_heads: int, layout: str, q_dtype: torch.dtype, capability: tuple[int, int] | None,
               merge: str = "auto", config: dict | None = None, kv_cache: torch.Tensor | None = None) -> str:
    """Which kernel sparse_mla_attention runs by itself: "gluon" (glm5lab.kernels.sparse_mla_sm90) or "triton".
    The Gluon kernels wherever they can run (gluon_unavailable), unless the call asks for something only the
    Triton kernel has: a fused merge, or any private Triton tile/path setting in _config. H200, NOTES.md v7 (<= 16
    heads): fp8 1.15-1.23x the Triton kernel at 128-512 tokens, 1.03-1.1x at 1-32; bf16 1.04-1.18x at 8-512 tokens
    (v9, 64-row steps up to one wave: 0.91 of the roofline at 8-16 heads x 128 tokens), 0.85-1.06x at 1 token.
    NOTES.md v8 (17-128 heads, wgmma): bf16 1.43-1.51x at 128-512 tokens at 64/128 heads, fp8 1.83-1.86x;
    1.05-1.4x at 1-32 tokens; v12: its warp-specialized form (the default) 1.15-1.19x more at 128-512 tokens."""
    if layout not in LAYOUTS[1:]:
        raise Glm5labError(f"unknown KV layout {layout!r}; expected one of {LAYOUTS[1:]}")
    _require_call(num_heads, q_dtype, layout, merge)
    if capability is not None and not (isinstance(capability, tuple) and len(capability) == 2
                                       and all(isinstance(c, int) for c in capability)):
        raise Glm5labError(f"capability must be a (major, minor) tuple, or None for no compiled NVIDIA launch; "
                           f"got {capability!r}")
    return _kernel_choice(num_heads, layout == "fp8_ds_mla", q_dtype, capability, merge, config, kv_cache)


def _kernel_choice(num_heads, fp8, q_dtype, capability, merge, config, kv_cache) -> str:
    """kernel_for() without its argument checks: sparse_mla_attention has made them already."""
    if merge == "fused" or config or gluon_unavailable(num_heads, fp8, q_dtype, capability, kv_cache):
        return "triton"
    return "gluon"


def _compiled_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a compiled NVIDIA launch on this device; None otherwise (CPU, interpreter, ROCm)."""
    return cuda_capability(device) if _nvidia_sm_at_least(device, (0, 0)) else None


def _gluon_by_default(q: torch.Tensor, fp8: bool, num_heads: int, merge: str, config: dict | None,
                      kv_cache: torch.Tensor | None = None) -> bool:
    """kernel_for() for this call's device (and cache)."""
    return _kernel_choice(num_heads, fp8, q.dtype, _compiled_capability(q.device), merge, config, kv_cache) == "gluon"


def _resolve_layout(kv_cache: torch.Tensor, layout: str, kv_lora_rank: int) -> str:
    if layout not in LAYOUTS:
        raise Glm5labError(f"unknown KV layout {layout!r}; expected one of {LAYOUTS}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise Glm5labError(f"kv_cache must be a [blocks, block_size, W] or [slots, W] tensor, got "
                           f"{type(kv_cache).__name__} {tuple(getattr(kv_cache, 'shape', ()))}")
    width = kv_cache.shape[-1]
    if layout == "auto":
        if kv_cache.dtype == torch.uint8 and width == FP8_ROW_BYTES:
            return "fp8_ds_mla"
        auto = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(kv_cache.dtype)
        if auto is None:
            raise Glm5labError(f"cannot infer the KV layout from a {kv_cache.dtype} cache of width {width}; "
                               "expected bf16/fp16 [.., 576] or uint8 [.., 656] (fp8_ds_mla)")
        layout = auto   # and its rows' width is checked as an explicit layout's is
    want = CACHE_DTYPE[layout]
    if kv_cache.dtype != want:
        raise Glm5labError(f"layout {layout!r} needs a {want} KV cache, got {kv_cache.dtype}")
    need = FP8_ROW_BYTES if layout == "fp8_ds_mla" else kv_lora_rank + ROPE
    if width != need:
        raise Glm5labError(f"layout {layout!r} needs rows of {need} elements, got {width}")
    return layout


def _kv_rows(kv_cache: torch.Tensor) -> tuple[int, int]:
    """(number of slots, row stride in elements) of a [blocks, block_size, W] or [slots, W] cache whose
    slots are evenly strided (what global slot = block * block_size + offset assumes)."""
    if kv_cache.dim() not in (2, 3):
        raise Glm5labError(f"kv_cache must be [blocks, block_size, W] or [slots, W], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise Glm5labError("kv_cache rows must be contiguous (last-dim stride 1)")
    row_stride = kv_cache.stride(-2)
    if kv_cache.dim() == 3 and kv_cache.shape[0] > 1 and kv_cache.stride(0) != kv_cache.shape[1] * row_stride:
        raise Glm5labError("kv_cache blocks must be evenly strided (block stride = block_size * row stride)")
    num_slots = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)
    return num_slots, row_stride


def sparse_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, softmax_scale: float,
                         *, kv_lora_rank: int = LATENT, layout: str = "auto", out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None, num_splits: int | None = None,
                         merge: str = "auto", _config: dict | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of each token over its own KV slots.

    q [T, H, 576] fp16/bf16; kv_cache [blocks, block_size, 576] fp16/bf16 (same dtype as q) or uint8
    [blocks, block_size, 656] (layout "fp8_ds_mla"); slots [T, topk] int32 GLOBAL slot indices
    (block * block_size + offset), -1 = skip, anywhere in the row; slots >= the cache size are skipped too.
    Returns (out [T, H, 512] in q.dtype, lse [T, H] float32, natural log); a token with no valid slot gets
    out = 0, lse = -inf. num_splits=None picks a split of the top-k that fills the GPU. merge: "separate" (a
    second kernel, parallel over heads and output columns), "fused" (the last program of a token merges: one
    launch, but one program reads every partial in turn) or "auto" (fused up to FUSED_MERGE_MAX_SPLITS splits,
    separate beyond). On an sm_90 GPU every call (fp8_ds_mla with bf16 q, or bf16/fp16 caches) runs a Gluon
    kernel of glm5lab.kernels.sparse_mla_sm90 (pipelined gathers; the kernel and tile by head count, layout and
    batch: sparse_mla_sm90.default_config; always the separate merge) unless merge="fused" or a private _config is
    given; _config={"impl": "triton"} or {"impl": "gluon"} picks one. Split partials are fp16 with a scale a head
    in the 64-head Gluon kernels (NOTES.md v14), fp32 elsewhere; _config={"partials": "fp32" | "fp16"} overrides
    (fp16: the Triton kernel and the 64-head Gluon kernels). Beyond 16 heads an fp8_ds_mla call whose splits cover
    >= 1024 rows runs the converter form (a producer warpgroup dequantizes; sparse_mla_sm90.converter_pays, NOTES.md
    v15); _config={"impl": "gluon", "converter": True | False} overrides (a _config without "impl" picks Triton).
    Their consumers pass P through shared memory instead of exchanging the scores (NOTES.md v16; "p_smem": False
    restores the exchange), and the converter form dequantizes into fp16 tiles with a power of two a step
    (NOTES.md v28; sparse_mla_sm90.f16_tile_pays; "f16_tile": False restores v15's bf16 tiles). The merge of an
    fp8_ds_mla call whose Gluon grid leaves half the SMs idle (1-2 tokens) is launched early, while the attention runs (programmatic dependent launch; sparse_mla_sm90.pdl_pays, NOTES.md v25);
    _config={"impl": "gluon", "pdl": False | True} decides. A dual-consumer 8-head tile runs one (token, split) a
    program unless its _config says {"one_item": False} (the persistent kernel, the default in NOTES.md v18-v35).
    Beyond one wave (more tokens than SMs) an fp8_ds_mla call of <= 16 heads runs the dual-consumer tiles' paired
    form, one consumer a CTA and two CTAs a SM (NOTES.md v38); a _config that names another kernel's tile, 4 stages,
    one_item False or {"paired": False} runs as it says (sparse_mla_sm90.resolve_paired).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise Glm5labError(f"q must be [tokens, heads, 576], got {tuple(getattr(q, 'shape', ()))}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise Glm5labError(f"q must be float16 or bfloat16, got {q.dtype}")
    if kv_lora_rank != LATENT:
        raise Glm5labError(f"the fused kernel is built for kv_lora_rank 512 (GLM-5, DeepSeek-V3.2), got {kv_lora_rank}")
    T, H, D = q.shape
    if D != LATENT + ROPE:
        raise Glm5labError(f"q width must be {LATENT + ROPE} (512 latent + 64 rope), got {D}")
    layout = _resolve_layout(kv_cache, layout, kv_lora_rank)
    _require_call(H, q.dtype, layout, merge)
    fp8 = layout == "fp8_ds_mla"
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2 or slots.shape[0] != T:
        raise Glm5labError(f"slots must be a [tokens={T}, topk] tensor, got "
                           f"{type(slots).__name__} {tuple(getattr(slots, 'shape', ()))}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise Glm5labError(f"slots must be int32 (or int64), got {slots.dtype}")
    softmax_scale = require_finite_scale(softmax_scale)
    require_launch_device(q=q, kv_cache=kv_cache, slots=slots, out=out, lse=lse)
    num_slots, kv_row_stride = _kv_rows(kv_cache)
    if num_slots >= 2**31:
        raise Glm5labError(f"cache of {num_slots} slots does not fit int32 slot indices")
    topk = slots.shape[1]

    if out is None:
        out = torch.empty(T, H, LATENT, dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, LATENT) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise Glm5labError(f"out must be [{T}, {H}, {LATENT}] {q.dtype} with contiguous rows, "
                           f"got {tuple(out.shape)} {out.dtype}")
    if lse is None:
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    elif lse.shape != (T, H) or lse.dtype != torch.float32 or lse.stride(-1) != 1:
        raise Glm5labError(f"lse must be [{T}, {H}] float32 with stride 1 on heads, got {tuple(lse.shape)} {lse.dtype}")
    if T == 0:
        return out, lse

    if q.stride(-1) != 1:
        q = q.contiguous()
    if slots.dtype != torch.int32:
        # int64 slots beyond the cache (even >= 2**31, which the cast would wrap onto real slots) become -1 on the
        # device first: skipped, as the kernels skip out-of-range int32 slots, and no host sync
        slots = torch.where((slots >= 0) & (slots < num_slots), slots, -1).to(torch.int32)
    if slots.stride(-1) != 1:
        slots = slots.contiguous()

    cfg = {**default_config(H, fp8, q.device), **(_config or {})}
    impl = cfg.get("impl", "auto")
    if impl not in ("auto", "triton", "gluon"):
        raise Glm5labError(f"unknown kernel impl {impl!r}; expected 'auto', 'triton' or 'gluon'")
    if impl == "gluon":
        why = gluon_unavailable(H, fp8, q.dtype, _compiled_capability(q.device), kv_cache)
        if why is not None:
            raise Glm5labError(why)
    gluon = impl == "gluon" or (impl == "auto" and _gluon_by_default(q, fp8, H, merge, _config, kv_cache))
    if gluon:
        from glm5lab.kernels import sparse_mla_sm90

        cfg = sparse_mla_sm90.resolve_paired(
            {**sparse_mla_sm90.default_config(H, fp8, T, sm_count(q.device)), **(_config or {})}, _config or {})
    if any(b is not None for b in cfg.get("_stamps") or ()) and not gluon:
        raise Glm5labError("phase stamps (_config '_stamps') come from the fp8_ds_mla Gluon kernels (the 1-3 token "
                           "kernel and its separate merge; the dual and paired kernels' wave stamps): add 'impl': "
                           "'gluon' (sm_90)")
    block_h, block_n = cfg["block_h"], cfg["block_n"]
    fp8_path = cfg.get("fp8_path", "default")
    if fp8_path in FP8_PATHS:
        reload, fp8_diag, words, f16 = FP8_PATHS[fp8_path]
    elif fp8_path in _FP8_DIAGNOSTICS and cfg.get("_diagnostic") is True:
        reload, fp8_diag, words, f16 = _FP8_DIAGNOSTICS[fp8_path]
    else:
        raise Glm5labError(f"unknown fp8 path {fp8_path!r}; expected one of {tuple(FP8_PATHS)}")
    if not fp8:
        reload, fp8_diag, words, f16 = False, 0, False, False   # the bf16/fp16 loop has a single path
    native = _native_e4m3(q.device)
    if fp8 and not native and not f16:
        if "fp8_path" in (_config or {}):
            raise Glm5labError(f"fp8 path {fp8_path!r} needs Triton's float8e4nv (NVIDIA sm_89+); this GPU runs "
                               "fp8_ds_mla through the 'f16' path")
        reload, fp8_diag, words, f16 = False, 0, False, True     # the default tiles, in the fp16 domain
    cvt = CVT_ASM if (native and not _interpreting()) else CVT_BITS
    head_tiles = cdiv(H, block_h)
    if num_splits is None:
        resident = cfg.get("resident", resident_ctas(block_h) if not gluon or cfg["stages"] <= 2 else 1)
        num_splits = choose_num_splits(T, head_tiles, topk, block_n, sm_count(q.device), resident)
    num_splits = int(max(1, min(num_splits, max(1, cdiv(topk, block_n)))))
    rows_per_split = cdiv(cdiv(max(topk, 1), num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max(topk, 1), rows_per_split))
    split = num_splits > 1
    if gluon and "converter" not in (_config or {}):
        cfg["converter"] = sparse_mla_sm90.converter_pays(fp8, cfg, rows_per_split)
    if gluon and "f16_tile" not in (_config or {}):
        cfg["f16_tile"] = sparse_mla_sm90.f16_tile_pays(fp8, cfg)
    if gluon and "kept_p" not in (_config or {}):
        cfg["kept_p"] = sparse_mla_sm90.kept_max_pays(fp8, cfg)
    wants_f16 = _partials_f16(cfg, gluon)
    if merge == "auto" or gluon:   # the Gluon kernel has no fused merge (nor does the fp16 partials' form)
        merge = "separate" if (num_splits > FUSED_MERGE_MAX_SPLITS or gluon or wants_f16) else "fused"
    if wants_f16 and merge == "fused":
        raise Glm5labError("fp16 partials need the separate merge (merge='separate' or 'auto'); the fused merge "
                           "reads fp32 partials")
    part_f16 = wants_f16 and split
    # PDL (the merge launched early): off by default for the Triton kernel -- on the H200 it saved 0.3-0.7 us at 1
    # token x 8-16 heads but cost up to 30% at 4-32 tokens in fp8 (NOTES.md v6); the Gluon kernels by
    # `sparse_mla_sm90.pdl_pays` (fp8_ds_mla grids of at most half the SMs, whose kernel lets the merge launch from
    # its start: v25, 0.5-0.7 us less at 1-2 tokens; elsewhere it cost up to 2.4x, v14 run 8); _config={"pdl": ...}
    # decides
    pdl_default = gluon and sparse_mla_sm90.pdl_pays(cfg, fp8, head_tiles * T * num_splits, sm_count(q.device))
    pdl = split and merge == "separate" and cfg.get("pdl", pdl_default) and _has_pdl(q.device)

    if split:
        part_o = torch.empty(T, num_splits, H, LATENT, dtype=torch.float16 if part_f16 else torch.float32,
                             device=q.device)
        part_lse = torch.empty(*((2,) if part_f16 else ()), T, num_splits, H, dtype=torch.float32, device=q.device)
        counter = _counter(q.device, T * head_tiles) if merge == "fused" else part_lse
    else:
        part_o = part_lse = counter = lse   # unused placeholders
    grid = (head_tiles, T, num_splits)
    args = (q, kv_cache, slots, out, lse, part_o, part_lse, counter,
            float(softmax_scale) * LOG2E, num_slots, H, topk, rows_per_split, num_splits,
            q.stride(0), q.stride(1), kv_row_stride, slots.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    if gluon:
        sparse_mla_sm90.launch(grid, args[:7] + args[8:], cfg, split, fp8, part_f16, H, sm_count(q.device), pdl)
    else:
        key = (str(q.device), block_h, block_n, cfg["num_warps"], fp8, q.dtype, split, merge, reload, fp8_diag,
               words, f16, cvt, cfg.get("maxnreg"), pdl, part_f16)
        _launch_triton(grid, args, key, cfg, block_h, block_n, fp8, split, merge, q.dtype, reload, fp8_diag, words,
                       f16, cvt, num_splits, pdl, part_f16)
    if split and merge == "separate":
        launch_merge(*merge_plan(H, num_splits, part_f16), part_o, part_lse, out, lse, pdl=pdl,
                     stamps=(cfg.get("_stamps") or (None, None))[1])
    return out, lse


def _partials_f16(cfg: dict, gluon: bool) -> bool:
    """Whether split partials are fp16: as _config={"partials": ...} says, else fp16 for the 64-head Gluon kernels
    (H200, NOTES.md v14 run 2: 64 heads fp8_ds_mla 8 / 32 tokens 24.1 -> 22.3 / 45.3 -> 43.3 us) and fp32 for the
    others (the <= 16-head Gluon kernels write 4-16x fewer partials and do not take fp16 ones; the Triton kernel's
    fp16 partials are not timed)."""
    partials = cfg.get("partials", "fp16" if gluon and cfg["block_h"] == 64 else "fp32")
    if partials not in ("fp32", "fp16"):
        raise Glm5labError(f"partials must be 'fp32' or 'fp16', got {partials!r}")
    return partials == "fp16"


def _launch_triton(grid, args, key, cfg, block_h, block_n, fp8, split, merge, q_dtype, reload, fp8_diag, words, f16,
                   cvt, num_splits, pdl, part_f16) -> None:
    """Launch the Triton kernel at the deepest pipeline that fits this GPU's shared memory (remembered per key)."""
    for stages in _stage_ladder(key, cfg["num_stages"]):
        try:
            _sparse_mla_fwd_kernel[grid](
                *args, BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, SPLIT=split, FUSED_MERGE=(merge == "fused"),
                UPCAST=(_interpreting() and q_dtype == torch.bfloat16), RELOAD=reload, FP8_DIAG=fp8_diag,
                WORDS=words, F16=f16, CVT=cvt, S_PAD=next_pow2(num_splits), PDL=pdl,
                PART_F16=part_f16, num_warps=cfg["num_warps"], num_stages=stages, **_register_cap(cfg))
            _STAGES[key] = stages
            return
        except OutOfResources:
            # GPUs with ~100 KB of shared memory (SM89, SM120) cannot double-buffer the largest tiles
            if stages == 1:
                raise Glm5labError(f"sparse MLA tile {block_h}x{block_n} does not fit this GPU's shared "
                                   "memory even single-buffered; pass _config={'block_n': 16}") from None


def sparse_mla_flops(num_tokens: int, num_heads: int, topk: int, kv_lora_rank: int = LATENT) -> float:
    """Useful FLOPs: Q.K^T over 576 plus P.V over 512, two per multiply-add."""
    return 2.0 * num_tokens * num_heads * topk * ((kv_lora_rank + ROPE) + kv_lora_rank)


def sparse_mla_min_bytes(num_tokens: int, num_heads: int, topk: int, layout: str, q_bytes: int = 2) -> float:
    """Bytes that must move at least: every token's top-k rows once, q read once, out written once
    (tokens x topk x row bytes + q + out; the 4-byte slot indices, +0.6%, and lse are left out)."""
    row = FP8_ROW_BYTES if layout == "fp8_ds_mla" else 2 * (LATENT + ROPE)
    return float(num_tokens * topk * row + num_tokens * num_heads * (LATENT + ROPE + LATENT) * q_bytes)
