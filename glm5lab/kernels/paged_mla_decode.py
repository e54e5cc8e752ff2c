"""glm5lab's own paged dense MLA decode kernel (Triton): the "dense path" the virtual block table feeds.

Absorbed (MQA) form, one shared latent KV row per cache slot:
  q [rows, heads, D] (D = kv_lora_rank + rope, GLM-5: 512 + 64), kv_cache [blocks, page_size, D],
  block_table [rows, max_blocks] int32/int64, seq_lens [rows]  ->  out [rows, heads, kv_lora_rank]
  (q's dtype) and lse [rows, heads] float32 (natural log).
Row b attends tokens j < seq_lens[b], token j at block_table[b, j // page_size], offset j % page_size.
Any page size, including 1 (the virtual block table). seq_len 0 gives out 0 and lse -inf, never NaN.

One program per (row, group of BLOCK_H heads, KV split): scores q_latent . k_latent + q_rope . k_rope
in fp32 (tl.dot), online softmax in base 2, P (rounded to the cache dtype, as flash attention does)
times the latent rows accumulated in fp32. With num_splits > 1 each split writes a partial (out, lse)
and a small torch merge combines them: long rows with few query tokens still fill the GPU.
Addresses are computed in int64 (block id x block stride overflows int32 on large caches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5lab.env import interpreter_mode as _interpreting
from glm5lab.errors import Glm5labError
from glm5lab.kernels.checks import index_vector, power_of_two, require_finite_scale, require_launch_device
from glm5lab.kernels.host import cdiv, next_pow2, sm_count

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation. WIDEN: Triton 3.6's interpreter multiplies bfloat16 tiles as their raw
    uint16 bits, so under TRITON_INTERPRET the (already bf16-rounded) operands are widened to fp32 first:
    the same products, exactly."""
    if WIDEN:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _paged_mla_decode_kernel(
    Q, KV, BT, SEQ, OUT, LSE,
    scale_log2,
    num_heads,
    stride_qr, stride_qh,
    stride_kvb, stride_kvp,
    stride_btr, stride_btb,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh, stride_ls,
    PAGE_SIZE: tl.constexpr,
    LATENT: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FINAL: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
):
    row = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < LATENT
    q_base = Q + row.to(tl.int64) * stride_qr + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    if ROPE > 0:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < ROPE
        q_rope = tl.load(q_base + LATENT + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    seq_len = tl.load(SEQ + row).to(tl.int32)
    per_split = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(BT + row.to(tl.int64) * stride_btr + (offs_n // PAGE_SIZE) * stride_btb,
                       mask=mask_n, other=0).to(tl.int64)
        kv_off = page * stride_kvb + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kvp
        k_lat = tl.load(KV + kv_off[:, None] + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :],
                        other=0.0)                                             # [N, L]
        s = _dot(q_lat, tl.trans(k_lat), IEEE, WIDEN)
        if ROPE > 0:
            k_rope = tl.load(KV + kv_off[:, None] + LATENT + offs_r[None, :],
                             mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            s += _dot(q_rope, tl.trans(k_rope), IEEE, WIDEN)
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing seen yet stay exact
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(k_lat.dtype), k_lat, IEEE, WIDEN)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptr = OUT + row.to(tl.int64) * stride_or + offs_h[:, None] * stride_oh + split * stride_os + offs_l[None, :]
    if FINAL:
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    else:
        tl.store(o_ptr, out, mask=mask_h[:, None] & mask_l[None, :])
    tl.store(LSE + row.to(tl.int64) * stride_lr + offs_h * stride_lh + split * stride_ls, lse, mask=mask_h)


def _default_splits(rows: int, head_blocks: int, max_len_hint: int, device: torch.device) -> int:
    """Enough programs to fill the GPU the call runs on when there are few rows; 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    programs = rows * head_blocks
    want = max(1, (2 * sm_count(device)) // max(1, programs))
    by_len = max(1, max_len_hint // 256)
    return int(min(want, by_len, 64))


def _output_buffer(buf, name, shape, dtype, device) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.device != device or not buf.is_contiguous():
        raise Glm5labError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                           f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    return buf


def paged_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, softmax_scale: float, kv_lora_rank: int = 512, *,
                     num_splits: int | None = None, block_h: int | None = None, block_n: int | None = None,
                     validate: bool = True, out: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged dense MLA decode. Returns (out [rows, heads, kv_lora_rank] in q.dtype, lse [rows, heads] fp32),
    written into `out` / `lse` when given (contiguous, those shapes and dtypes).

    `validate` (default) checks seq_lens against the block table width and the used block ids against
    the cache; it synchronizes with the device, so timing loops pass validate=False.
    """
    if q.dim() != 3:
        raise Glm5labError(f"q must be [rows, heads, D], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 3:
        raise Glm5labError(f"kv_cache must be [blocks, page_size, D], got shape {tuple(kv_cache.shape)}")
    if q.dtype not in _FLOAT_DTYPES or kv_cache.dtype != q.dtype:
        raise Glm5labError(f"q and kv_cache must share one dtype of float16/bfloat16/float32, "
                           f"got {q.dtype} and {kv_cache.dtype}")
    rows, heads, width = q.shape
    num_blocks, page_size, kv_width = kv_cache.shape
    if kv_width != width:
        raise Glm5labError(f"q width {width} != kv row width {kv_width}")
    if not 0 < kv_lora_rank <= width:
        raise Glm5labError(f"kv_lora_rank {kv_lora_rank} out of range for width {width}")
    if block_table.dim() != 2 or block_table.shape[0] != rows:
        raise Glm5labError(f"block_table must be [rows={rows}, max_blocks], got shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise Glm5labError(f"block_table must be int32 or int64, got {block_table.dtype}")
    seq_lens = index_vector("seq_lens", seq_lens, rows)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    softmax_scale = require_finite_scale(softmax_scale)
    block_h, block_n = power_of_two("block_h", block_h, 16), power_of_two("block_n", block_n, 16)
    require_launch_device(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens, out=out)
    if validate and rows:
        max_len = int(seq_lens.max())
        if int(seq_lens.min()) < 0:
            raise Glm5labError("seq_lens must be >= 0")
        if max_len > block_table.shape[1] * page_size:
            raise Glm5labError(f"seq_len {max_len} needs more than the block table's {block_table.shape[1]} "
                               f"blocks of {page_size}")
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size \
            < seq_lens.long()[:, None]
        if bool(used.any()):
            ids = block_table[used]
            if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
                raise Glm5labError(f"block_table uses block ids in [{int(ids.min())}, {int(ids.max())}], "
                                   f"outside the cache's {num_blocks} blocks")
    else:
        max_len = block_table.shape[1] * page_size

    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()
    rope = width - kv_lora_rank
    block_l = max(16, next_pow2(kv_lora_rank))
    block_r = max(16, next_pow2(rope)) if rope else 16
    if block_h is None:
        block_h = min(64, max(16, next_pow2(heads))) if not q.is_cuda else 16
    if block_n is None:
        block_n = 32 if q.is_cuda else 64
    head_blocks = cdiv(heads, block_h)
    splits = int(num_splits) if num_splits else _default_splits(rows, head_blocks, max_len, q.device)
    if splits < 1:
        raise Glm5labError(f"num_splits must be >= 1, got {num_splits}")

    out = _output_buffer(out, "out", (rows, heads, kv_lora_rank), q.dtype, q.device)
    lse = _output_buffer(lse, "lse", (rows, heads), torch.float32, q.device)
    if rows == 0 or heads == 0:
        return out, lse
    final = splits == 1
    if final:
        part_o, part_l = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part_o = torch.empty((rows, heads, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
        part_l = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    grid = (rows, head_blocks, splits)
    _paged_mla_decode_kernel[grid](
        q, kv_cache, block_table, seq_lens, part_o, part_l,
        float(softmax_scale) * LOG2E, heads,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), block_table.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_l.stride(0), part_l.stride(1), part_l.stride(2),
        PAGE_SIZE=page_size, LATENT=kv_lora_rank, ROPE=rope, BLOCK_L=block_l, BLOCK_R=block_r,
        BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=splits, FINAL=final,
        IEEE=q.dtype == torch.float32,
        WIDEN=q.dtype == torch.bfloat16 and _interpreting(),
        num_warps=4 if block_h <= 16 else 8, num_stages=2,
    )
    if not final:
        out_f, lse_f = merge_partials(part_o, part_l)
        out.copy_(out_f)
        lse.copy_(lse_f)
    return out, lse


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine split-KV partials: out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s.
    part_out [..., S, L], part_lse [..., S] (an empty split has lse -inf and weight 0)."""
    lse = torch.logsumexp(part_lse, dim=-1)
    w = torch.exp(part_lse - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    w = torch.where(torch.isinf(part_lse), torch.zeros_like(w), w)
    return (w[..., None] * part_out).sum(dim=-2), lse
