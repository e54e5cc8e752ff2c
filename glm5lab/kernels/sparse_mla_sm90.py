"""Sparse MLA in Gluon for Hopper (fp8_ds_mla, and bf16/fp16 caches): the next steps' gathers are in flight during
this step.

Why a second kernel (NOTES.md v6/v7): in the Triton kernel's sm90 build the pipeliner keeps ONE shared buffer per
gathered chunk and issues the next step's gathers after this step's dots (their addresses come from a slot load in
the same iteration), so inside a program the step is [wait for DRAM] then [compute], never both -- the fp8 loop sat
at 0.34 of the memory roofline. Gluon (Triton's explicit-layout dialect) lets us write the pipeline ourselves
(H200: 0.42 of the roofline at 512 tokens, 1.12x FlashMLA's fp8 decode; ncu: L1/shared pipe 84% busy, DRAM 27%):
- a ring of STAGES shared buffers filled by cp.async; step i+STAGES-1's rows are requested at the top of step i,
  their slot indices were loaded one step earlier still, so a step never waits on an address;
- each step dequantizes its raw e4m3 rows ONCE into an fp16 tile (one conversion per two values on sm_89+), from
  which both products read through ldmatrix (Q.K^T without, P.V with the transpose);
- the scores are moved once into the P operand's layout (every warp then holds the whole [heads, rows] tile): the
  row max, the softmax and the per-chunk scaling of P need no further exchange between warps.
Same arithmetic as the Triton kernel's "f16" path (q's latent part scaled per head by a power of two into fp16,
chunk scales applied to the scores and to P, P.V in fp16 relative to the running largest scale), same outputs and
partials, so the separate merge of `sparse_mla` serves both. NVIDIA sm_90 only (the one GPU it was tested on); bf16 q.
The bf16/fp16-cache kernel (`_sparse_mla_16bit_sm90_kernel`) is the same pipeline without the dequantization: both
products read the ring slot itself (H200: 0.91 of the roofline at 8-16 heads x 128 tokens with 64-row steps on one
CTA a SM, the Triton kernel 0.76).
Beyond 16 heads the work is compute-heavy (64 heads: as many FLOPs as bytes on the H200): `_sparse_mla_wgmma_sm90_
kernel` takes 64-head tiles on two warpgroups with wgmma reading q and the rows from shared memory (H200, NOTES.md
v8: 1.4-1.9x the Triton kernel at 128-512 tokens, 0.64-0.76x FlashMLA's kernels there); the default is its
warp-specialized form `_sparse_mla_wgmma_ws_sm90_kernel` (a loader warpgroup issues the gathers; v12: 1.15-1.18x
the one-CTA form at 64 heads x 128-512 tokens, 0.84-0.88x FlashMLA's kernels); for fp8_ds_mla splits of >= 1024
rows its converter form `_sparse_mla_wgmma_cv_sm90_kernel` takes the dequantization off the consumers (a producer
warpgroup converts each step in place in a 2-slot ring of bf16 tiles; v15: 4-10% faster at 128-512 tokens, 0.89-0.92x
FlashMLA's fp8 decode at 64 heads); since v16 their consumers pass P to P.V through shared memory rather than
exchanging the scores (2-8% faster); since v28 the converter's tiles are fp16, divided by a power of two a step
(`_step_pow2`; 0.956 / 0.994x FlashMLA's fp8 decode at 64 heads x 128 / 512 tokens, from 0.924 / 0.957), and since
v29 O is kept relative to that power of two and the scales' reduction is one REDUX (0.982 / 1.028x). At small
batches of bf16/fp16 caches `_sparse_mla_rows_sm90_kernel` puts the gathered rows in the wgmma's M instead (8-16
heads cannot fill it).
For fp8_ds_mla at <= 16 heads the default (beyond 1-3 tokens at <= 8 heads) is `_sparse_mla_rows_fp8_sm90_kernel`, the
same rows-as-M products on a warp-specialized pipeline of three warpgroups: a loader issues the gathers, a converter
turns each step's e4m3 rows once into an fp16 tile, the consumer computes on the previous one (H200, NOTES.md v12:
0.52-0.55 of the roofline, 1.43-1.44x FlashMLA's fp8 decode at 128-512 tokens); at 9-16 heads from 24 tokens
(64 before v36) its dual-consumer form `_sparse_mla_rows_fp8_dual_sm90_kernel`: no converter and no fp16 tile --
two consumer warpgroups read the staged e4m3 bytes straight into wgmma's register operand (the bytes a thread needs
lie together once q's columns and O's rows are permuted to match) and take every other step, each with its own softmax
state (v17: 0.65-0.69 of the roofline, 1.77-1.83x FlashMLA's fp8 decode at 128-512 tokens; since v19 O^T's products
issued two at a time: 0.67-0.70, 1.82-1.84x; since v34 S^T's too where the top-k is not split: ~1% more; since v35 P^T's
wgmma descriptors rebuilt each step instead of spilled: 5-9% more, 2.06 / 2.14x at 128 / 512); at <= 8 heads from 16
tokens the same kernel on 8-head tiles, one item a program, since v36 (2-8% faster at 16-128 tokens than what follows,
equal at 512); in v18-v35 the same two consumers on 8-head tiles in a persistent kernel,
`_sparse_mla_rows_fp8_persistent_sm90_kernel` (one program a SM walks the (token, split) items through one ring; v18:
0.79 of the roofline, 2.1x at 512 tokens; since v19 both products issued two at a time: 0.76 / 0.81, 2.11 / 2.18x at 128
/ 512 tokens; since v20 three at a time once the top-k is not split, 2-5% faster there in interleaved A/B rounds: 0.76 /
0.83, 2.10 / 2.24x in one same-run comparison, 0.76 / 0.80 and 2.12 / 2.11x in the suite; v21's suite, in interleaved
rounds: 0.75 / 0.84 and 2.10 / 2.24x). Beyond one wave (more tokens than SMs) both tiles run as
`_sparse_mla_rows_fp8_paired_sm90_kernel` since v38: the same step on ONE consumer warpgroup, 2 stages, two CTAs a SM,
so that a program's start and end overlap the other CTA's steps (4-9% faster at 136-512 tokens; 0.91 of the roofline
at 8 heads x 512 tokens, 2.31x FlashMLA at 16 heads x 512, in v38's A/B).
No interpreter runs Gluon: tests/test_sparse_mla_sm90.py checks it on the GPU, and its sm90 build offline.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from glm5lab.errors import Glm5labError
# Triton jit helpers; Gluon calls them as they are
from glm5lab.kernels.f16_domain import pow2_into_f16_range
from glm5lab.kernels.sparse_mla import _E4M3X4_TO_F16X4, STAMP_SLOTS, check_stamps, partial_scale_plane

# an fp8_ds_mla row (glm5lab.kernels.fp8_ds_mla, 656 bytes): 512 e4m3, 4 float32 scales, 64 bf16 rope values
ROPE_OFFSET = gl.constexpr(528)
SCALE_OFFSET = gl.constexpr(512)
# registers a thread of the warp-specialized 64-head kernel's loader warpgroup (setmaxnreg; the two consumer
# warpgroups get the rest of the 12 warps' 168 each)
WS64_LOADER_REGS = gl.constexpr(56)
# ... and of the fp8_ds_mla 64-head kernel's producer warpgroup (gathers and dequantization; the consumers get 208:
# no spill in either partition of the sm90 build -- 104 / 200 left the consumers one 8-byte slot)
WS64_CONVERTER_REGS = gl.constexpr(88)

# The 64-head kernels' tile (8 warps = two warpgroups), one geometry for the one-CTA and the warp-specialized form:
# O [heads, 512] split by columns between the warpgroups; P in P.V's A-operand layout (a warp holds whole head rows:
# the row reductions stay in-warp); q and the rows staged by the 8 warps; e4m3 chunks [rows, 128] dequantized by them.
_HEADS_O = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
_HEADS_P = gl.DotOperandLayout(operand_index=0, parent=_HEADS_O, k_width=2)
HEADS_O_L = gl.constexpr(_HEADS_O)
HEADS_O_ROWS = gl.constexpr(gl.SliceLayout(1, _HEADS_O))
# The lazy rescale of O (NOTES.md v30; FlashAttention-4's conditional rescale): the running max moves only when a
# step's max exceeds it by more than LAZY_TAU (log2 units), so p <= 2^LAZY_TAU and on most steps every head's alpha
# is 1; a warp whose rows all have alpha 1 then skips O's multiply (`_lazy_rescaled`).
LAZY_TAU = gl.constexpr(8.0)


def _lazy_rescale_asm(n: int) -> tuple:
    """PTX and its constraints for `_lazy_rescaled` on a thread's n accumulator values ($0..$n-1, tied to inputs
    $n..$2n-1) and their alphas ($2n..$3n-1): values 0 and 2 of the wgmma accumulator are its two rows (r, r + 8),
    so the warp votes on their alphas and branches around the n multiplies when none differs from 1."""
    muls = "".join(f"mul.f32 ${j}, ${j}, ${2 * n + j}; " for j in range(n))
    asm = ("{ .reg .pred a, b; "
           f"setp.neu.f32 a, ${2 * n}, 0f3F800000; setp.neu.f32 b, ${2 * n + 2}, 0f3F800000; or.pred a, a, b; "
           f"vote.sync.any.pred a, a, 0xffffffff; @!a bra.uni skip; {muls}skip: }}")
    return asm, ",".join(["=f"] * n + [str(j) for j in range(n)] + ["f"] * n)


# ... and P against the kept max (`_kept_max_softmax`, NOTES.md v31): the eight consumer warps' flags [4 head blocks,
# 2 warpgroups], every thread holding all eight (no reduction across warps to read them)
KEPT_FLAGS_ALL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [1, 0], [2, 0]], lane_bases=[[0, 0]] * 5, warp_bases=[[0, 0]] * 3, block_bases=[],
    shape=[4, 2]))
# ... the dual consumers' form (`_kept_max_rows`): a consumer's four warps' flags [4], every thread holding all four,
# and how far a chunk scale may pass the kept r before r moves (P^T = p * s_c / r <= 2^8 x 2^4 in fp16)
ROWS_FLAGS_ALL = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1], [2]], lane_bases=[[0]] * 5, warp_bases=[[0]] * 2, block_bases=[], shape=[4]))
KEPT_R_SLACK = gl.constexpr(16.0)
LAZY_VALUES = gl.constexpr(128)     # O's values a consumer thread holds: [64 heads, 512] over two warpgroups
LAZY_RESCALE_ASM, LAZY_RESCALE_CONSTRAINTS = (gl.constexpr(x) for x in _lazy_rescale_asm(LAZY_VALUES.value))
HEADS_P_A = gl.constexpr(_HEADS_P)
HEADS_P_ROWS = gl.constexpr(gl.SliceLayout(1, _HEADS_P))
HEADS_P_COLS = gl.constexpr(gl.SliceLayout(0, _HEADS_P))
HEADS_LAT16 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))     # [rows, 512] 16-bit, 16-byte pieces
HEADS_ROPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))       # [rows, 64] 16-bit
HEADS_DQ = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0]))        # [rows, 128] e4m3 -> bf16
# The copy layouts of a 4-warp loader / producer warpgroup (one for each warp-specialized kernel): a warp's cp.async
# covers 512 bytes of ONE row (NOTES.md v11: 64 bytes of eight rows was 8% slower), rope [rows, 64] 16-bit, the
# scales [4 chunks, rows] float32
WG_LAT8 = gl.constexpr(gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0]))        # [rows, 512] e4m3
WG_LAT16 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))        # [rows, 512] 16-bit
WG_ROPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
WG_SCALE = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [1, 4], [0, 1]))
# ... and of a 4-warp converter / producer warpgroup's dequantization: [rows, 128] e4m3 chunks
WG_DQ = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
# ... and every warp of it holding all four chunk scales of a 64-row step (8 a thread; warps replicated, so that each
# warp reduces them alone, without a barrier: the fp16 tile's power of two, `_step_pow2`)
WG_STEP_SCALES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 8], [0, 16], [0, 32], [1, 0], [2, 0]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 64]))
# fp16 partials [heads, 512] in stored-column order (sparse_mla.stored_column): the O tile's own threads and
# registers, renamed so that a thread's 4 values of a head row are adjacent (one 8-byte store; sm90 build: 32 STG.E.64)
HEADS_F16_STORE = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32], [0, 64], [0, 128]],
    lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [0, 256]], block_bases=[],
    shape=[64, 512]))


@gluon.jit
def _let_merge_launch(PDL: gl.constexpr):
    """PDL (programmatic dependent launch, sm90): let the merge grid launch now -- its programs take idle SMs and wait
    in griddepcontrol.wait until this grid has finished and its stores are visible, so the merge's launch is off the
    critical path. By default only where the grid leaves half the SMs idle (`pdl_pays`)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


# The phase stamps of the 1-3 token fp8_ds_mla kernel (a diagnostic: `latency_anatomy --phases`, NOTES.md v27): the
# stamp slots it writes (clock64 unless "global"), stamps 4-7 for its first step and 8-11 for its last.
PHASES = {0: "start (global)", 1: "start", 2: "first rows requested (slot indices in)", 3: "q staged",
          4: "step rows in shared memory", 5: "step dequantized", 6: "step scores and softmax issued",
          7: "step P.V issued", 8: "last step rows in shared memory", 9: "last step dequantized",
          10: "last step scores and softmax issued", 11: "last step P.V issued", 12: "partial's stores issued",
          13: "end (global)", 14: "step: every warp past its first barrier (q staged by all)",
          15: "step: this thread's row copies complete"}


@gluon.jit
def _stamp_slot(STAMPS, k: gl.constexpr):
    """Where this program's stamp k goes: its row of STAMP_SLOTS values in the buffer, by its place in the grid."""
    prog = (gl.program_id(1) * gl.num_programs(2) + gl.program_id(2)) * gl.num_programs(0) + gl.program_id(0)
    return STAMPS + prog.to(gl.int64) * STAMP_SLOTS + k


@gluon.jit
def _stamp(STAMPS, k: gl.constexpr, GLOBAL: gl.constexpr = False):
    """Phase stamp k of this program (PHASES): clock64 now, in program order -- a warp issues in order, so after every
    instruction before it has issued, i.e. after whatever their operands waited for; GLOBAL: globaltimer (ns, one
    clock for all SMs). Off (STAMPS None): nothing."""
    if STAMPS is not None:
        if GLOBAL:
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                            pack=1)
        else:
            now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(_stamp_slot(STAMPS, k), now)


# The wave stamps of the dual and paired fp8_ds_mla kernels (a diagnostic: `glm5lab.bench.wave_spread`, NOTES.md
# v44): when each program starts and ends on the GPU's one clock, and on which SM, in the phase stamps' buffer layout.
WAVE_STAMPS = {0: "start (global)", 1: "SM id", 13: "end (global)"}


@gluon.jit
def _stamp_sm(STAMPS, k: gl.constexpr):
    """Stamp k of this program: the id of the SM it runs on (%smid). Off (STAMPS None): nothing."""
    if STAMPS is not None:
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.store(_stamp_slot(STAMPS, k), sm.to(gl.int64))


@gluon.jit
def _wave_start(STAMPS):
    """WAVE_STAMPS 0-1: the program's start and its SM."""
    _stamp(STAMPS, 0, GLOBAL=True)
    _stamp_sm(STAMPS, 1)


@gluon.jit
def _first_step_stamp(STAMPS, i, k: gl.constexpr):
    """Phase stamp k of the first step only (PHASES 14-15, inside `_ring_next`)."""
    if STAMPS is not None:
        if i == 0:
            _stamp(STAMPS, k)


@gluon.jit
def _step_stamp(STAMPS, i, num_steps, k: gl.constexpr):
    """Phase stamp k (4-7) of the first step i, k + 4 of the last (PHASES)."""
    _first_step_stamp(STAMPS, i, k)
    if STAMPS is not None:
        if i == num_steps - 1:
            _stamp(STAMPS, k + 4)


@gluon.jit
def _slots(SLOTS_ROW, n0, n_end, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Slot indices of rows [n0, n0 + BLOCK_N) of this split in `layout` (-1 past the split's end)."""
    offs = n0 + gl.arange(0, BLOCK_N, layout=layout)
    return gl.load(SLOTS_ROW + offs, mask=offs < n_end, other=-1)


@gluon.jit
def _valid_rows(slots, num_slots, OFFS32: gl.constexpr = False):
    """(which slots name a cache row, the row each copy reads: 0 for the others, whose copies are zero-filled).
    OFFS32: one unsigned bounds check (slot -1 is 2^32 - 1 unsigned) and 32-bit rows; else 64-bit rows."""
    if OFFS32:
        ok = slots.to(gl.uint32, bitcast=True) < num_slots.to(gl.uint32, bitcast=True)
        return ok, gl.where(ok, slots, 0)
    else:
        ok = (slots >= 0) & (slots < num_slots)
        return ok, gl.where(ok, slots, 0).to(gl.int64)


@gluon.jit
def _copy_rows(buf, KV, row_stride, slots, num_slots, OFFSET: gl.constexpr, WIDTH: gl.constexpr, DT: gl.constexpr,
               L: gl.constexpr, OFFS32: gl.constexpr = False):
    """cp.async WIDTH values of type DT starting OFFSET cache elements into each gathered row, into buf [rows,
    WIDTH]; rows with slot -1 or past the cache are not read (zero-filled). OFFS32 (`launch`: a cache of < 2^31
    elements): a row's offset a 32-bit product (`_valid_rows`)."""
    ok, rows = _valid_rows(slots, num_slots, OFFS32)
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
    ptr = (KV + rows[:, None] * row_stride + OFFSET).to(gl.pointer_type(DT)) + cols[None, :]
    async_copy.async_copy_global_to_shared(buf, ptr, mask=ok[:, None])


@gluon.jit
def _request_rows(KV, row_stride, num_slots, sl_lat, sl_rope, sl_scale, lat_buf, rope_buf, scale_buf,
                  LAT: gl.constexpr, ROPE_L: gl.constexpr, SCALE_L: gl.constexpr, OFFS32: gl.constexpr = False):
    """One ring slot of fp8_ds_mla rows: the 512 e4m3 bytes, 64 bf16 rope values and (chunk-major) 4 scales
    (OFFS32: `_copy_rows`)."""
    _copy_rows(lat_buf, KV, row_stride, sl_lat, num_slots, 0, 512, gl.uint8, LAT, OFFS32)
    _copy_rows(rope_buf, KV, row_stride, sl_rope, num_slots, ROPE_OFFSET, 64, gl.bfloat16, ROPE_L, OFFS32)
    ok, rows = _valid_rows(sl_scale, num_slots, OFFS32)
    chunk = gl.arange(0, 4, layout=gl.SliceLayout(1, SCALE_L))
    ptr = (KV + rows[None, :] * row_stride + SCALE_OFFSET).to(gl.pointer_type(gl.float32)) + chunk[:, None]
    async_copy.async_copy_global_to_shared(scale_buf, ptr, mask=ok[None, :])
    async_copy.commit_group()


@gluon.jit
def _request_rows_16bit(KV, row_stride, num_slots, sl_lat, sl_rope, lat_buf, rope_buf,
                        LAT16: gl.constexpr, ROPE_L: gl.constexpr):
    """One ring slot of bf16/fp16 rows: 512 latent + 64 rope values."""
    DT: gl.constexpr = KV.dtype.element_ty
    _copy_rows(lat_buf, KV, row_stride, sl_lat, num_slots, 0, 512, DT, LAT16)
    _copy_rows(rope_buf, KV, row_stride, sl_rope, num_slots, 512, 64, DT, ROPE_L)
    async_copy.commit_group()


@gluon.jit
def _ring_slots(slot_row, n0, n_end, BLOCK_N: gl.constexpr, LAT: gl.constexpr, ROPE_L: gl.constexpr,
                SCALE_L: gl.constexpr, FP8: gl.constexpr):
    """Slot indices of the rows from n0 on in the layouts of the three copies (bf16/fp16: no scale copy, the rope
    slots stand in)."""
    sl_lat = _slots(slot_row, n0, n_end, BLOCK_N, gl.SliceLayout(1, LAT))
    sl_rope = _slots(slot_row, n0, n_end, BLOCK_N, gl.SliceLayout(1, ROPE_L))
    if FP8:
        sl_scale = _slots(slot_row, n0, n_end, BLOCK_N, gl.SliceLayout(0, SCALE_L))
    else:
        sl_scale = sl_rope
    return sl_lat, sl_rope, sl_scale


@gluon.jit
def _request_step(KV, row_stride, num_slots, slot_row, n_next, n_end, lat_buf, rope_buf, scale_buf,
                  sl_lat, sl_rope, sl_scale, BLOCK_N: gl.constexpr, LAT: gl.constexpr, ROPE_L: gl.constexpr,
                  SCALE_L: gl.constexpr, FP8: gl.constexpr, OFFS32: gl.constexpr = False):
    """Request one ring slot's rows (their slot indices were loaded a step earlier), then load the slot indices of
    the rows from n_next on for the next request: a step never waits on an address. Returns those indices."""
    if FP8:
        _request_rows(KV, row_stride, num_slots, sl_lat, sl_rope, sl_scale, lat_buf, rope_buf, scale_buf,
                      LAT, ROPE_L, SCALE_L, OFFS32)
    else:
        _request_rows_16bit(KV, row_stride, num_slots, sl_lat, sl_rope, lat_buf, rope_buf, LAT, ROPE_L)
    return _ring_slots(slot_row, n_next, n_end, BLOCK_N, LAT, ROPE_L, SCALE_L, FP8)


@gluon.jit
def _split_rows(s, rows_per_split, topk, BLOCK_N: gl.constexpr):
    """Split s's rows [n_start, n_end) of the token's top-k and how many BLOCK_N-row steps cover them."""
    n_start = s * rows_per_split
    n_end = gl.minimum(n_start + rows_per_split, topk)
    return n_start, n_end, gl.cdiv(n_end - n_start, BLOCK_N)


@gluon.jit
def _ring_start(SLOTS, t, s, stride_st, rows_per_split, topk, KV, row_stride, num_slots, lat_ring, rope_ring,
                scale_stages, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LAT: gl.constexpr, ROPE_L: gl.constexpr,
                SCALE_L: gl.constexpr, FP8: gl.constexpr):
    """This split's rows [n_start, n_end) of the token's top-k, with its first STAGES - 1 steps requested into the
    ring. Returns (n_start, n_end, slot_row, num_steps, and the slot indices of the next request)."""
    n_start, n_end, num_steps = _split_rows(s, rows_per_split, topk, BLOCK_N)
    slot_row = SLOTS + t * stride_st
    nx_lat, nx_rope, nx_scale = _ring_slots(slot_row, n_start, n_end, BLOCK_N, LAT, ROPE_L, SCALE_L, FP8)
    for j in gl.static_range(STAGES - 1):
        nx_lat, nx_rope, nx_scale = _request_step(
            KV, row_stride, num_slots, slot_row, n_start + (j + 1) * BLOCK_N, n_end, lat_ring.index(j),
            rope_ring.index(j), scale_stages.index(j), nx_lat, nx_rope, nx_scale, BLOCK_N, LAT, ROPE_L, SCALE_L, FP8)
    return n_start, n_end, slot_row, num_steps, nx_lat, nx_rope, nx_scale


@gluon.jit
def _ring_next(i, KV, row_stride, num_slots, slot_row, n_start, n_end, lat_ring, rope_ring, scale_stages,
               nx_lat, nx_rope, nx_scale, sl_cols, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LAT: gl.constexpr,
               ROPE_L: gl.constexpr, SCALE_L: gl.constexpr, COLS: gl.constexpr, FP8: gl.constexpr, STAMPS=None):
    """The top of step i: once every warp is done with step i - 1's ring slot (and whatever else it read), request
    step i + STAGES - 1 into it (its slots arrived a step ago) and load the slots of the request after; load the
    next step's slot indices in layout COLS (for masking); then wait until step i's rows (every thread's copies)
    are in shared memory. Returns (next request's slots, step i's slot indices, step i + 1's, ring slot b of i)."""
    nxt = (i + STAGES - 1) % STAGES
    gl.thread_barrier()
    _first_step_stamp(STAMPS, i, 14)
    nx_lat, nx_rope, nx_scale = _request_step(
        KV, row_stride, num_slots, slot_row, n_start + (i + STAGES) * BLOCK_N, n_end, lat_ring.index(nxt),
        rope_ring.index(nxt), scale_stages.index(nxt), nx_lat, nx_rope, nx_scale, BLOCK_N, LAT, ROPE_L, SCALE_L, FP8)
    cur_cols = sl_cols
    sl_cols = _slots(slot_row, n_start + (i + 1) * BLOCK_N, n_end, BLOCK_N, COLS)
    b = i % STAGES
    async_copy.wait_group(STAGES - 1)
    _first_step_stamp(STAMPS, i, 15)
    gl.thread_barrier()
    return nx_lat, nx_rope, nx_scale, cur_cols, sl_cols, b


@gluon.jit
def _softmax_totals(l_i, m_i, r_i):
    """(r / l, lse in log2 units) per head; a head with no valid slot (l = 0) gets 0 and -inf."""
    empty = l_i == 0.0
    return (gl.where(empty, 0.0, r_i / gl.where(empty, 1.0, l_i)),
            gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i))))


@gluon.jit
def _online_softmax(s_tile, slots, num_slots, qk_scale_log2, m_i, l_acc, AXIS: gl.constexpr):
    """One step of the online softmax on a score tile whose gathered rows lie along AXIS (1: [heads, rows], 0: the
    rows-as-M kernels' S^T [rows, heads]): reduced along the rows, once per head. Returns (p, alpha, new max, l_acc),
    l kept per element and summed once at the end; slots -1 / past the cache score -inf; exp2 stays finite while a
    head has seen no valid slot."""
    s_tile = _masked_scores(s_tile, slots, num_slots, qk_scale_log2, AXIS)
    return _softmax_update(s_tile, gl.max(s_tile, AXIS), m_i, l_acc, AXIS)


@gluon.jit
def _masked_scores(s_tile, slots, num_slots, qk_scale_log2, AXIS: gl.constexpr):
    """The scores in log2 units, -inf where the slot is -1 or past the cache (rows along AXIS)."""
    ok = (slots >= 0) & (slots < num_slots)
    return gl.where(gl.expand_dims(ok, 1 - AXIS), s_tile * qk_scale_log2, float("-inf"))


@gluon.jit
def _online_softmax_lazy(s_tile, slots, num_slots, qk_scale_log2, m_i, l_acc, AXIS: gl.constexpr):
    """`_online_softmax` keeping the running max until a step's exceeds it by more than LAZY_TAU: p <= 2^LAZY_TAU
    (fp16 / bf16 and the float32 sums hold it), alpha 1 on the steps that keep it (`_lazy_rescaled`)."""
    s_tile = _masked_scores(s_tile, slots, num_slots, qk_scale_log2, AXIS)
    return _lazy_update(s_tile, gl.max(s_tile, AXIS), m_i, l_acc, AXIS)


@gluon.jit
def _lazy_update(s_tile, tile_max, m_i, l_acc, AXIS: gl.constexpr):
    """`_softmax_update` under the lazy rule: the running max moves to the tile's only when that exceeds it by more
    than LAZY_TAU (`_online_softmax_lazy`, and the dual consumers' rare path in `_kept_max_rows`)."""
    return _softmax_update(s_tile, _lazy_max(tile_max, m_i), m_i, l_acc, AXIS)


@gluon.jit
def _lazy_max(tile_max, m_i):
    """The lazy rule: the running max m_i moves to the tile's only when that exceeds it by more than LAZY_TAU."""
    return gl.where(tile_max > m_i + LAZY_TAU, tile_max, m_i)


@gluon.jit
def _lazy_rescaled(acc, alpha):
    """O [heads, 512] (the 64-head kernels' accumulator, HEADS_O_L) times alpha [heads] (HEADS_O_ROWS) -- skipped by
    each warp none of whose rows' alpha differs from 1 (`_online_softmax_lazy`): 128 multiplies a thread a step
    off the path between the softmax and P.V on most steps."""
    gl.static_assert(acc.shape[0] * acc.shape[1] == LAZY_VALUES * 32 * gl.num_warps(),
                     "the accumulator values a thread holds are the PTX's")
    a, _ = gl.broadcast(alpha[:, None], acc)
    return gl.inline_asm_elementwise(LAZY_RESCALE_ASM, LAZY_RESCALE_CONSTRAINTS, [acc, a], dtype=gl.float32,
                                     is_pure=True, pack=LAZY_VALUES)


@gluon.jit
def _kept_max_softmax(s_tile, slots, num_slots, qk_scale_log2, m_i, l_rows, p_tile, p_flags):
    """`_online_softmax_lazy` for the 64-head consumers without a reduction across the warpgroups on most steps
    (NOTES.md v31): P is computed against the KEPT max and stored at once, each warp flags whether any of its scores
    exceeds the kept max by more than LAZY_TAU, and P's own barrier carries the flags. Only when a flag is up (the
    first step, a moved max; uniform over the consumers' partition: every thread reads all eight) the step's max is
    reduced across the warpgroups and P is computed and stored again, behind a second barrier. l is kept per head
    and warpgroup (l_rows [heads, 2], `_kept_rows`): P need not live past its store. Returns (alpha, new max,
    l_rows) with P in p_tile, ready for P.V."""
    s_tile = _masked_scores(s_tile, slots, num_slots, qk_scale_log2, 1)
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s_tile - gl.expand_dims(m_ref, 1))
    p_tile.store(p.to(p_tile.dtype))
    l_new = l_rows + _kept_rows(p, gl.sum)
    # a warp's flag: any of its 16 heads' maxima over its 32 rows above the kept max + LAZY_TAU (heads 16 w..16 w +
    # 15, rows 32 g..32 g + 31: the reductions stay in the warp)
    w_max = _kept_rows(s_tile, gl.max)
    up = (w_max > gl.expand_dims(gl.convert_layout(m_i + LAZY_TAU, gl.SliceLayout(1, w_max.type.layout)), 1))
    p_flags.store(gl.max(gl.reshape(up.to(gl.int32), [4, 16, 2]), 1))
    fence_async_shared()
    gl.thread_barrier()
    alpha = gl.full_like(m_i, 1.0)
    m_new = m_i
    if _warp_uniform(gl.max(gl.max(p_flags.load(KEPT_FLAGS_ALL), 1), 0)) != 0:
        tile_max = gl.max(s_tile, 1)
        m_new = _lazy_max(tile_max, m_i)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s_tile - gl.expand_dims(m_safe, 1))
        p_tile.store(p.to(p_tile.dtype))
        a_rows = gl.convert_layout(alpha, gl.SliceLayout(1, l_rows.type.layout))
        l_new = l_rows * gl.expand_dims(a_rows, 1) + _kept_rows(p, gl.sum)
        fence_async_shared()
        gl.thread_barrier()
    return alpha, m_new, l_new


@gluon.jit
def _warp_uniform(x):
    """x (an int32 scalar every thread of the warp holds alike) through a warp vote, so that ptxas knows a branch on
    it is uniform (or it keeps the wgmma descriptors in ordinary registers around it, and spills them)."""
    return gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; "
                                     "selp.s32 $0, 1, 0, p; }", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _kept_rows(x, reduce: gl.constexpr):
    """A [heads, rows] score tile reduced over each warpgroup's 32 columns, in-warp: [heads, 2]."""
    return reduce(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), 2)


@gluon.jit
def _softmax_update(s_tile, tile_max, m_i, l_acc, AXIS: gl.constexpr):
    """`_online_softmax` after the reduction: the new max from the tile's (tile_max), the rescale alpha, p, l_acc."""
    m_new = gl.maximum(m_i, tile_max)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s_tile - gl.expand_dims(m_safe, AXIS))
    return p, alpha, m_new, l_acc * gl.expand_dims(alpha, AXIS) + p


@gluon.jit
def _online_softmax_step(qk, slot_cols, num_slots, qk_scale_log2, m_i, l_acc, A_OP: gl.constexpr):
    """The [heads, rows] kernels' step: the scores moved into the P operand's layout first (the one exchange between
    warps a step: every warp then holds whole head rows, so the reductions stay in-warp), then _online_softmax."""
    return _online_softmax(gl.convert_layout(qk, A_OP), slot_cols, num_slots, qk_scale_log2, m_i, l_acc, 1)


@gluon.jit
def _store_result(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, l_i, r_i, m_i, t, s, pid_h, num_heads,
                  num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                  MMA: gl.constexpr, P_ROWS: gl.constexpr):
    """out = acc * r / l (or the split's normalized partial) and lse; a head with no valid slot gets 0 and -inf.
    r: the unit the accumulators are kept in (the fp8 kernel's running largest scale; 1 otherwise)."""
    O_ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    inv_l, lse2 = _softmax_totals(l_i, m_i, r_i)
    inv_l = gl.convert_layout(inv_l, O_ROWS)[:, None]
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=O_ROWS)
    hm = heads < num_heads
    dcol = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    heads_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=P_ROWS)
    if SPLIT:
        part = t * num_splits + s
        po = PART_O + (part * num_heads + heads[:, None]) * 512 + dcol[None, :]
        gl.store(po, acc0 * inv_l, mask=hm[:, None])
        gl.store(po + 128, acc1 * inv_l, mask=hm[:, None])
        gl.store(po + 256, acc2 * inv_l, mask=hm[:, None])
        gl.store(po + 384, acc3 * inv_l, mask=hm[:, None])
        gl.store(PART_LSE + part * num_heads + heads_l, lse2, mask=heads_l < num_heads)
    else:
        o = OUT + t * stride_ot + heads[:, None] * stride_oh + dcol[None, :]
        gl.store(o, (acc0 * inv_l).to(OUT.dtype.element_ty), mask=hm[:, None])
        gl.store(o + 128, (acc1 * inv_l).to(OUT.dtype.element_ty), mask=hm[:, None])
        gl.store(o + 256, (acc2 * inv_l).to(OUT.dtype.element_ty), mask=hm[:, None])
        gl.store(o + 384, (acc3 * inv_l).to(OUT.dtype.element_ty), mask=hm[:, None])
        gl.store(LSE + t * stride_lt + heads_l, lse2 * 0.6931471805599453, mask=heads_l < num_heads)


@gluon.jit
def _q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H: gl.constexpr,
                   QL: gl.constexpr, K_ORDER: gl.constexpr = False, ROPE_MUL: gl.constexpr = False):
    """The fp8 kernels' q: its latent part scaled per head by a power of two into fp16 range (exact) into q_lat
    [4, BLOCK_H, 128] (chunk-major), the rope part as is (bf16) into q_rope [BLOCK_H, 64]. Returns the per-head
    multiplier (in SliceLayout(1, QL)); the scores are divided by it. K_ORDER: each chunk's columns in the order
    the dual-consumer kernel reads the rows' bytes into registers (`_k_order`). ROPE_MUL (PIPE_F): the rope part times
    the multiplier too (exact, a power of two, unless the rope part is 2^114 times the latent part's largest value),
    so that the whole score is q_mul times the true one and one multiply a score unscales it."""
    heads_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    hm_q = heads_q < num_heads
    d128 = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    q_rows = Q + t * stride_qt + heads_q[:, None] * stride_qh
    q0 = gl.load(q_rows + d128[None, :], mask=hm_q[:, None], other=0.0).to(gl.float32)
    q1 = gl.load(q_rows + 128 + d128[None, :], mask=hm_q[:, None], other=0.0).to(gl.float32)
    q2 = gl.load(q_rows + 256 + d128[None, :], mask=hm_q[:, None], other=0.0).to(gl.float32)
    q3 = gl.load(q_rows + 384 + d128[None, :], mask=hm_q[:, None], other=0.0).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(q0), 1), gl.max(gl.abs(q1), 1)),
                      gl.maximum(gl.max(gl.abs(q2), 1), gl.max(gl.abs(q3), 1)))
    q_mul = pow2_into_f16_range(amax)
    if K_ORDER:
        q_lat.index(0).store(_k_order((q0 * q_mul[:, None]).to(gl.float16)))
        q_lat.index(1).store(_k_order((q1 * q_mul[:, None]).to(gl.float16)))
        q_lat.index(2).store(_k_order((q2 * q_mul[:, None]).to(gl.float16)))
        q_lat.index(3).store(_k_order((q3 * q_mul[:, None]).to(gl.float16)))
    else:
        q_lat.index(0).store((q0 * q_mul[:, None]).to(gl.float16))
        q_lat.index(1).store((q1 * q_mul[:, None]).to(gl.float16))
        q_lat.index(2).store((q2 * q_mul[:, None]).to(gl.float16))
        q_lat.index(3).store((q3 * q_mul[:, None]).to(gl.float16))
    d64 = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    rope = gl.load(q_rows + 512 + d64[None, :], mask=hm_q[:, None], other=0.0)
    if ROPE_MUL:
        rope = (rope.to(gl.float32) * q_mul[:, None]).to(gl.bfloat16)
    q_rope.store(rope)
    return q_mul


@gluon.jit
def _sparse_mla_fp8_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    PDL: gl.constexpr = False, STAMPS=None,
):
    """<= 16 heads of an fp8_ds_mla cache on mma.sync (the default at 1-3 tokens of <= 8 heads): each step's e4m3 rows
    dequantized once into an fp16 tile, the products in the fp16 domain. q is staged after the first gathers are
    requested, so that its load is in flight beside theirs (NOTES.md v23: 9.1 -> 8.6 us at 8 heads x 1 token).
    STAMPS: the phase stamps (PHASES), a diagnostic."""
    _stamp(STAMPS, 0, GLOBAL=True)
    _stamp(STAMPS, 1)
    _let_merge_launch(PDL)
    NW: gl.constexpr = gl.num_warps()
    # scores [BLOCK_H, BLOCK_N] and outputs [BLOCK_H, 128]: mma.sync tiles, warps side by side along the columns
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    P_ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)          # per head, in the P operand's layout
    P_COLS: gl.constexpr = gl.SliceLayout(0, A_OP)          # per gathered row, in the P operand's layout
    O_ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    O_COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    # copies: 16 bytes a thread for the latent bytes and rope, 4 for the scales
    LAT: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NW, 1], [1, 0])       # [BLOCK_N, 512] uint8
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])      # [BLOCK_N, 64] bf16
    SCALE_L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, NW], [0, 1])     # [4, BLOCK_N] float32 (chunk, row)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])         # q chunks [BLOCK_H, 128]
    RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    # (a [STAGES, ...] buffer takes the layout of one stage)
    SWZ2: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    gl.static_assert(BLOCK_N % (8 * NW) == 0, "BLOCK_N must be a multiple of 8 x num_warps (scale copies)")

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    # ---- q: latent part scaled per head into fp16 range (exact: a power of two), rope part as is (bf16)
    q_lat = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 128], SWZ2)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], SWZ2)

    # ---- the ring of gathered rows, and the fp16 tile each step's rows are dequantized into
    lat_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW)
    rope_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SWZ2)
    scale_ring = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], VEC)   # stage b: rows 4b .. 4b + 3
    scale_stages = scale_ring._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], RAW)      # the same bytes by stage
    kv16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, 512], SWZ2)

    n_start, n_end, slot_row, num_steps, nx_lat, nx_rope, nx_scale = _ring_start(
        SLOTS, t, s, stride_st, rows_per_split, topk, KV, kv_row_stride, num_slots, lat_ring, rope_ring, scale_stages,
        BLOCK_N, STAGES, LAT, ROPE_L, SCALE_L, True)
    _stamp(STAMPS, 2)
    q_mul = _q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, QL)
    _stamp(STAMPS, 3)
    q_unscale = gl.convert_layout(1.0 / q_mul, O_ROWS)
    sl_cols = _slots(slot_row, n_start, n_end, BLOCK_N, P_COLS)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=P_ROWS)
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=A_OP)
    r_i = 1.1754943508222875e-38          # running largest chunk scale (P.V in fp16 relative to it)
    acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    zero_qk = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)

    for i in range(num_steps):
        nx_lat, nx_rope, nx_scale, cur_cols, sl_cols, b = _ring_next(
            i, KV, kv_row_stride, num_slots, slot_row, n_start, n_end, lat_ring, rope_ring, scale_stages, nx_lat,
            nx_rope, nx_scale, sl_cols, BLOCK_N, STAGES, LAT, ROPE_L, SCALE_L, P_COLS, True, STAMPS)
        _step_stamp(STAMPS, i, num_steps, 4)
        raw = lat_ring.index(b).load(LAT)
        kv16.store(raw.to(gl.float8e4nv, bitcast=True).to(gl.float16))
        gl.thread_barrier()
        _step_stamp(STAMPS, i, num_steps, 5)

        # scores: four fp16 latent products, each times its chunk's scale, then the bf16 rope product
        s0 = scale_ring.index(4 * b + 0).load(O_COLS)
        s1 = scale_ring.index(4 * b + 1).load(O_COLS)
        s2 = scale_ring.index(4 * b + 2).load(O_COLS)
        s3 = scale_ring.index(4 * b + 3).load(O_COLS)
        qk = mma_v2(q_lat.index(0).load(A_OP), kv16.slice(0, 128, dim=1).permute((1, 0)).load(B_OP), zero_qk) * s0[None, :]
        qk += mma_v2(q_lat.index(1).load(A_OP), kv16.slice(128, 128, dim=1).permute((1, 0)).load(B_OP), zero_qk) * s1[None, :]
        qk += mma_v2(q_lat.index(2).load(A_OP), kv16.slice(256, 128, dim=1).permute((1, 0)).load(B_OP), zero_qk) * s2[None, :]
        qk += mma_v2(q_lat.index(3).load(A_OP), kv16.slice(384, 128, dim=1).permute((1, 0)).load(B_OP), zero_qk) * s3[None, :]
        qk = mma_v2(q_rope.load(A_OP), rope_ring.index(b).permute((1, 0)).load(B_OP), qk * q_unscale[:, None])

        p, alpha, m_i, l_acc = _online_softmax_step(qk, cur_cols, num_slots, qk_scale_log2, m_i, l_acc, A_OP)
        _step_stamp(STAMPS, i, num_steps, 6)

        p0 = scale_ring.index(4 * b + 0).load(P_COLS)
        p1 = scale_ring.index(4 * b + 1).load(P_COLS)
        p2 = scale_ring.index(4 * b + 2).load(P_COLS)
        p3 = scale_ring.index(4 * b + 3).load(P_COLS)
        r_new = gl.maximum(r_i, gl.max(gl.maximum(gl.maximum(p0, p1), gl.maximum(p2, p3)), 0))
        keep = gl.convert_layout(alpha * (r_i / r_new), O_ROWS)[:, None]
        inv_r = 1.0 / r_new
        acc0 = mma_v2((p * (p0 * inv_r)[None, :]).to(gl.float16), kv16.slice(0, 128, dim=1).load(B_OP), acc0 * keep)
        acc1 = mma_v2((p * (p1 * inv_r)[None, :]).to(gl.float16), kv16.slice(128, 128, dim=1).load(B_OP), acc1 * keep)
        acc2 = mma_v2((p * (p2 * inv_r)[None, :]).to(gl.float16), kv16.slice(256, 128, dim=1).load(B_OP), acc2 * keep)
        acc3 = mma_v2((p * (p3 * inv_r)[None, :]).to(gl.float16), kv16.slice(384, 128, dim=1).load(B_OP), acc3 * keep)
        r_i = r_new
        _step_stamp(STAMPS, i, num_steps, 7)

    async_copy.wait_group(0)
    _store_result(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, gl.sum(l_acc, 1), r_i, m_i, t, s, pid_h,
                  num_heads, num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, MMA, P_ROWS)
    _stamp(STAMPS, 12)
    _stamp(STAMPS, 13, GLOBAL=True)


@gluon.jit
def _sparse_mla_16bit_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """The same pipeline for bf16/fp16 caches (q in the cache's dtype): no dequantization -- both products read the
    ring slot itself through ldmatrix -- and no scales; P enters P.V in the input dtype, as in the Triton kernel."""
    _let_merge_launch(PDL)
    NW: gl.constexpr = gl.num_warps()
    DT: gl.constexpr = Q.dtype.element_ty
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    P_ROWS: gl.constexpr = gl.SliceLayout(1, A_OP)
    P_COLS: gl.constexpr = gl.SliceLayout(0, A_OP)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
    LAT16: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])      # [BLOCK_N, 512], 16-byte copies
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])      # [BLOCK_N, 64]
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    SWZ2: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    q_lat = gl.allocate_shared_memory(DT, [4, BLOCK_H, 128], SWZ2)
    q_rope = gl.allocate_shared_memory(DT, [BLOCK_H, 64], SWZ2)
    heads_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QL))
    hm_q = heads_q < num_heads
    d128 = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    q_rows = Q + t * stride_qt + heads_q[:, None] * stride_qh
    for c in gl.static_range(4):
        q_lat.index(c).store(gl.load(q_rows + c * 128 + d128[None, :], mask=hm_q[:, None], other=0.0))
    q_rope.store(gl.load(q_rows + 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, QL))[None, :], mask=hm_q[:, None],
                         other=0.0))

    lat_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, 512], SWZ2)
    rope_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, 64], SWZ2)

    n_start, n_end, slot_row, num_steps, nx_lat, nx_rope, nx_scale = _ring_start(
        SLOTS, t, s, stride_st, rows_per_split, topk, KV, kv_row_stride, num_slots, lat_ring, rope_ring, rope_ring,
        BLOCK_N, STAGES, LAT16, ROPE_L, ROPE_L, False)
    sl_cols = _slots(slot_row, n_start, n_end, BLOCK_N, P_COLS)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=P_ROWS)
    l_acc = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=A_OP)
    acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)
    acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=MMA)

    for i in range(num_steps):
        nx_lat, nx_rope, nx_scale, cur_cols, sl_cols, b = _ring_next(
            i, KV, kv_row_stride, num_slots, slot_row, n_start, n_end, lat_ring, rope_ring, rope_ring, nx_lat,
            nx_rope, nx_scale, sl_cols, BLOCK_N, STAGES, LAT16, ROPE_L, ROPE_L, P_COLS, False)
        kv = lat_ring.index(b)
        qk = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=MMA)
        for c in gl.static_range(4):
            qk = mma_v2(q_lat.index(c).load(A_OP), kv.slice(c * 128, 128, dim=1).permute((1, 0)).load(B_OP), qk)
        qk = mma_v2(q_rope.load(A_OP), rope_ring.index(b).permute((1, 0)).load(B_OP), qk)

        p, alpha, m_i, l_acc = _online_softmax_step(qk, cur_cols, num_slots, qk_scale_log2, m_i, l_acc, A_OP)
        keep = gl.convert_layout(alpha, O_ROWS)[:, None]
        pv = p.to(DT)
        acc0 = mma_v2(pv, kv.slice(0, 128, dim=1).load(B_OP), acc0 * keep)
        acc1 = mma_v2(pv, kv.slice(128, 128, dim=1).load(B_OP), acc1 * keep)
        acc2 = mma_v2(pv, kv.slice(256, 128, dim=1).load(B_OP), acc2 * keep)
        acc3 = mma_v2(pv, kv.slice(384, 128, dim=1).load(B_OP), acc3 * keep)

    async_copy.wait_group(0)
    _store_result(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, gl.sum(l_acc, 1), 1.0, m_i, t, s, pid_h,
                  num_heads, num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, MMA, P_ROWS)


@gluon.jit
def _q_for_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, BLOCK_H: gl.constexpr, SM: gl.constexpr,
                 LAT16: gl.constexpr, ROPE_L: gl.constexpr):
    """This tile's q as wgmma operands: latent [BLOCK_H, 512] and rope [BLOCK_H, 64] in shared memory (heads past
    num_heads zero)."""
    q_lat, q_rope = _q_wgmma_buffers(Q.dtype.element_ty, BLOCK_H, SM)
    _stage_q_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, LAT16, ROPE_L)
    return q_lat, q_rope


@gluon.jit
def _q_wgmma_buffers(DT: gl.constexpr, BLOCK_H: gl.constexpr, SM: gl.constexpr, LAT_DT: gl.constexpr = None):
    """Shared memory for a tile's q as wgmma operands: latent [BLOCK_H, 512] (in LAT_DT when given: the fp16 tile's
    q, `_stage_q_wgmma`) and rope [BLOCK_H, 64] in DT."""
    if LAT_DT is None:
        q_lat = gl.allocate_shared_memory(DT, [BLOCK_H, 512], SM)
    else:
        q_lat = gl.allocate_shared_memory(LAT_DT, [BLOCK_H, 512], SM)
    return q_lat, gl.allocate_shared_memory(DT, [BLOCK_H, 64], SM)


@gluon.jit
def _stage_q_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H: gl.constexpr,
                   LAT16: gl.constexpr, ROPE_L: gl.constexpr):
    """q's latent and rope parts into q_lat [BLOCK_H, 512] and q_rope [BLOCK_H, 64] as they are (`_q_for_wgmma`).
    The fp16 tile (q_lat fp16, q bf16; NOTES.md v28): both parts times a power of two a head that brings the latent
    part's largest value into [2^14, 2^15) (`pow2_into_f16_range`, exact), the latent part then in fp16, the rope
    part still bf16; returns that multiplier [BLOCK_H] (SliceLayout(1, LAT16); the scores are divided by it), else
    1.0."""
    heads_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LAT16))
    q_rows = Q + t * stride_qt + heads_q[:, None] * stride_qh
    lat = gl.load(q_rows + gl.arange(0, 512, layout=gl.SliceLayout(0, LAT16))[None, :],
                  mask=(heads_q < num_heads)[:, None], other=0.0)
    if q_lat.dtype == Q.dtype.element_ty:
        q_lat.store(lat)
        q_rope.store(_q_rope_part(Q, t, stride_qt, stride_qh, pid_h, num_heads, BLOCK_H, ROPE_L))
        q_mul = 1.0
    else:
        rope = _q_rope_part(Q, t, stride_qt, stride_qh, pid_h, num_heads, BLOCK_H, ROPE_L)
        lat = lat.to(gl.float32)
        q_mul = pow2_into_f16_range(gl.max(gl.abs(lat), 1))
        q_lat.store((lat * q_mul[:, None]).to(q_lat.dtype))
        rope_mul = gl.convert_layout(q_mul, gl.SliceLayout(1, ROPE_L))
        q_rope.store((rope.to(gl.float32) * rope_mul[:, None]).to(q_rope.dtype))
    return q_mul


@gluon.jit
def _q_rope_part(Q, t, stride_qt, stride_qh, pid_h, num_heads, BLOCK_H: gl.constexpr, ROPE_L: gl.constexpr):
    """This tile's q rope part [BLOCK_H, 64] in layout ROPE_L (heads past num_heads zero)."""
    heads_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROPE_L))
    return gl.load(Q + t * stride_qt + heads_r[:, None] * stride_qh + 512
                   + gl.arange(0, 64, layout=gl.SliceLayout(0, ROPE_L))[None, :],
                   mask=(heads_r < num_heads)[:, None], other=0.0)


@gluon.jit
def _heads_buffers(Q, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                   F16_TILE: gl.constexpr = False):
    """The 64-head kernels' shared memory: this tile's q (not staged: `_stage_q_wgmma`; the warp-specialized kernels'
    consumers stage it while the loader gathers), then a ring of STAGES slots of BLOCK_N gathered rows --
    fp8_ds_mla: raw e4m3 bytes, the scales ([4b + c] = stage b, chunk c; by stage for the copies) and ONE bf16 tile
    they are dequantized into; bf16/fp16: the rows themselves (the scale and tile names then alias the rope ring,
    never touched). F16_TILE (the converter form's, which calls this with FP8 False; NOTES.md v28): q's latent part
    and the ring of tiles in fp16. Returns (q_lat, q_rope, lat_ring, rope_ring, scale_ring, scale_stages, kv_deq)."""
    DT: gl.constexpr = Q.dtype.element_ty
    TILE_DT: gl.constexpr = gl.float16 if F16_TILE else DT
    SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_lat, q_rope = _q_wgmma_buffers(DT, BLOCK_H, SM, TILE_DT)
    rope_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, 64], SM)
    if FP8:
        lat_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW)
        scale_ring = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], VEC)
        scale_stages = scale_ring._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], RAW)
        kv_deq = gl.allocate_shared_memory(DT, [BLOCK_N, 512], SM)
    else:
        lat_ring = gl.allocate_shared_memory(TILE_DT, [STAGES, BLOCK_N, 512], SM)
        scale_ring = rope_ring
        scale_stages = rope_ring
        kv_deq = rope_ring
    return q_lat, q_rope, lat_ring, rope_ring, scale_ring, scale_stages, kv_deq


@gluon.jit
def _scaled(raw, sc, DT: gl.constexpr):
    """e4m3 bytes raw [rows, cols] times their scales sc [rows] in float32, rounded once to DT (q's dtype) -- as
    FlashMLA dequantizes. DT fp16 (the 64-head kernels' fp16 tile, NOTES.md v28): e4m3 to fp16 (exact) times the
    scale rounded to fp16, in fp16 -- two instructions per two values instead of six, one fp16 rounding of the
    scale and one of the product (relative error <= 2^-10 while both are fp16 normals); the scales come in divided by
    the step's power of two (`_step_pow2`: values below 57,344 inside its window, below 896 outside it)."""
    if DT == gl.float16:
        return raw.to(gl.float8e4nv, bitcast=True).to(gl.float16) * sc.to(gl.float16)[:, None]
    else:
        return (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]).to(DT)


@gluon.jit
def _dequantized(raw_rows, scales, c: gl.constexpr, DT: gl.constexpr, DQ: gl.constexpr, unscale=1.0):
    """Chunk c (128 values a row) of e4m3 rows raw_rows [rows, 512] with their scales [rows] (times unscale: the
    fp16 tile's 2^-e, `_step_pow2`), `_scaled`."""
    return _scaled(raw_rows.slice(c * 128, 128, dim=1).load(DQ), scales.load(gl.SliceLayout(1, DQ)) * unscale, DT)


@gluon.jit
def _dequant_chunk(lat_ring, scale_ring, kv_deq, b, c: gl.constexpr):
    """Chunk c of ring slot b's e4m3 rows dequantized into the bf16 tile kv_deq (`_dequantized`)."""
    kv_deq.slice(c * 128, 128, dim=1).store(
        _dequantized(lat_ring.index(b), scale_ring.index(4 * b + c), c, kv_deq.dtype, HEADS_DQ))


@gluon.jit
def _step_pow2(step_scales):
    """The fp16 tile's power of two a step (NOTES.md v28): 2^e by which a ring slot's rows are divided in the tile
    (step_scales [4, 64] in shared memory). e = 0 while the step's largest chunk scale lies in [2^-12, 2^7) (values
    below 57,344 and that scale an fp16 normal: latents whose chunk maxima lie between 0.11 and 57,344 -- an
    RMS-normalized latent of 512 values stays below 22.6 times its norm's largest weight), else e = its exponent
    clamped to [-40, 40], so that the tile holds K / 2^e with scales / 2^e < 2 and values < 896: no overflow for
    scales below 2^47. Digits are lost to fp16's subnormals where a chunk's scale / 2^e < 2^-14 (a value's error up
    to ~448 * 2^-25 * 2^e): rows whose scales lie ~2^25 below the step's largest (an outlier above 57,344 among
    ordinary rows of ONE step) flush to zero in the tile (an fp16 scale below 2^-25 rounds to 0). Other steps lose
    nothing: the consumers keep O relative to the step's 2^e, not P (NOTES.md v29). One factor a step: the consumers
    fold it into head vectors, and the rope part is divided alike only when e != 0 (`_rope_unscaled`). Every warp
    reads all 256 scales (WG_STEP_SCALES) and reduces them itself, no barrier: the largest |scale| as integer bits
    (ordered as the floats are; a NaN scale, which the float max ignored, gives e = 40 -- its row's output is NaN
    either way), so that the lanes' reduction is one REDUX instead of five shuffle rounds (NOTES.md v29: 64 heads
    fp8 x 128 tokens 0.951 -> 0.982x FlashMLA). Returns the float32 bits of 2^e (a scalar)."""
    mb = gl.max(gl.reshape(step_scales.load(WG_STEP_SCALES).to(gl.int32, bitcast=True) & 0x7FFFFFFF, [256]), 0)
    exp = (mb >> 23) - 127
    e = gl.where((exp >= -12) & (exp < 7), 0, gl.minimum(gl.maximum(exp, -40), 40))
    return gl.where(mb > 0, (127 + e) << 23, 127 << 23)


@gluon.jit
def _stored_pow2(scale_ring, b, L: gl.constexpr):
    """The step's 2^e (`_step_pow2`) as the converter form's producer left it in place of chunk 0's scales, as
    vectors in layout L (every value the same): (e as float32, 2^e, 2^-e), exact."""
    bits = scale_ring.index(4 * b).load(L).to(gl.int32, bitcast=True)
    return (((bits >> 23) - 127).to(gl.float32), bits.to(gl.float32, bitcast=True),
            ((254 << 23) - bits).to(gl.float32, bitcast=True))


@gluon.jit
def _rope_unscaled(rope, unscale, L: gl.constexpr):
    """The fp16 tile's rows' rope part (bf16 [rows, 64] in shared memory, layout L) times unscale = 2^-e in place
    (exact in bf16), so that q.K^T over the whole row is the true score / 2^e (`_step_pow2`)."""
    rope.store(rope.load(L) * unscale.to(rope.dtype))


@gluon.jit
def _heads_step(q_lat, q_rope, lat_ring, rope_ring, scale_ring, kv_deq, b, cur_cols, num_slots, qk_scale_log2, m_i,
                l_i, acc, zero_s, FP8: gl.constexpr, DEQUANT: gl.constexpr = True, p_tile=None,
                P_SMEM: gl.constexpr = False, F16_TILE: gl.constexpr = False, POW2: gl.constexpr = True, pow_h=None,
                o_ratio=None, KEPT_P: gl.constexpr = False, p_flags=None, opaque0=0):
    """One 64-row step of the 64-head kernels on ring slot b (its rows in shared memory): S = q.K^T split by rows
    between the warpgroups, the scores moved once into P.V's A-operand layout (each warp then holds whole head
    rows: row max and sum in-warp), the online softmax, P.V split by columns. fp8_ds_mla: the slot's e4m3 chunks
    dequantized with their scale into the bf16 tile kv_deq first (FlashMLA's rounding; DEQUANT=False, a timing
    diagnostic: the products read kv_deq as it stands). P_SMEM (NOTES.md v16): no exchange of S -- Triton's
    layout conversion ran it in 4 rounds through a 4 KB buffer, 8 CTA barriers a step, with 5-6-way bank conflicts
    (ncu) --; the row max is reduced across the warpgroups and P [heads, rows] is stored once into p_tile, the A
    operand of P.V; and O is rescaled lazily (NOTES.md v30): a head's running max moves only when a step's exceeds
    it by more than LAZY_TAU (P <= 2^8), and each warp whose heads all keep theirs skips O's multiply
    (`_online_softmax_lazy`, `_lazy_rescaled`). F16_TILE (the converter form's, with P_SMEM; NOTES.md v28): its
    producer left the step's tile in fp16 divided by the step's power of two, the rope part alike, and 2^e in
    scale_ring (`_step_pow2`); q's latent part is in fp16, qk_scale_log2 a [heads, 1] column (`_qk_scale_heads`)
    that the step's pow_h = 2^e (a head vector) multiplies: the online softmax over the true scores, and O kept in
    units of the step's 2^e (acc rescaled by alpha * o_ratio, o_ratio = 2^(the previous step's e - e), exact), so
    that P <= 2^8 is fp16-safe and no step's P falls to fp16's subnormals for another step's power of two (NOTES.md
    v29). POW2 False: a private A/B switch, NOTES.md v28 -- no power of two, the tile's values e4m3 x scale as they
    are, which overflow fp16 beyond 65504. KEPT_P (with P_SMEM; NOTES.md v31): P against the kept max, the row max
    reduced across the warpgroups only on the steps a warp flags (`_kept_max_softmax`; l then [heads, 2]); opaque0:
    the step's 0 the compiler cannot see, for q's descriptors. Returns (m, l, acc)."""
    DT: gl.constexpr = q_lat.dtype
    if FP8:
        if DEQUANT:
            for c in gl.static_range(4):
                _dequant_chunk(lat_ring, scale_ring, kv_deq, b, c)
            gl.thread_barrier()
        kv = kv_deq
    else:
        kv = lat_ring.index(b)
    fence_async_shared()          # shared-memory writes (cp.async / st.shared) -> wgmma reads
    if KEPT_P:   # (q's wgmma descriptors rebuilt each step from an index that is 0, but not to the compiler: ptxas
        #          kept them across the loop, beside the rare path's registers, and spilled them)
        q_lat = q_lat._reinterpret(q_lat.dtype, [1, q_lat.shape[0], q_lat.shape[1]], q_lat.type.layout).index(opaque0)
    qk = warpgroup_mma(q_lat, kv.permute((1, 0)), zero_s)
    qk = warpgroup_mma(q_rope, rope_ring.index(b).permute((1, 0)), qk)
    if P_SMEM:
        # each warpgroup keeps its 32 columns of S: the row max is the one reduction across them, l stays per
        # element (l_i: [heads, rows], summed at the end; KEPT_P: [heads, 2]), and P goes once through shared memory
        # as P.V's A operand and the running max is kept until a step's exceeds it by LAZY_TAU (log2 units): O's
        # rescale, skipped by each warp whose heads all keep it (NOTES.md v30)
        if F16_TILE and POW2:
            qk_scale_log2 = qk_scale_log2 * gl.expand_dims(pow_h, 1)
        if KEPT_P:
            alpha, m_new, l_i = _kept_max_softmax(qk, cur_cols, num_slots, qk_scale_log2, m_i, l_i, p_tile, p_flags)
            if F16_TILE and POW2:
                alpha = alpha * o_ratio
        else:
            p, alpha, m_new, l_i = _online_softmax_lazy(qk, cur_cols, num_slots, qk_scale_log2, m_i, l_i, 1)
            if F16_TILE and POW2:
                alpha = alpha * o_ratio
            p_tile.store(p.to(DT))
            fence_async_shared()
            gl.thread_barrier()
        acc = warpgroup_mma(p_tile, kv, _lazy_rescaled(acc, gl.convert_layout(alpha, HEADS_O_ROWS)))
    else:
        p, alpha, m_new, _ = _online_softmax_step(qk, cur_cols, num_slots, qk_scale_log2, m_i, 0.0, HEADS_P_A)
        l_i = l_i * alpha + gl.sum(p, 1)   # (l as a vector here: the per-column l_acc above goes unused)
        acc = warpgroup_mma(p.to(DT), kv, acc * gl.convert_layout(alpha, HEADS_O_ROWS)[:, None])
    return m_new, l_i, acc


@gluon.jit
def _heads_state(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, P_SMEM: gl.constexpr = False):
    """The 64-head kernels' state before the first step: running max, sum, O and the zero S tile a step's q.K^T
    starts from (S split by rows between the warpgroups: BLOCK_N / 2 rows each). P_SMEM: max and sum in S's own
    layout, the sum per element."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    if P_SMEM:
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
    else:
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=HEADS_P_ROWS)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=HEADS_P_ROWS)
    return m_i, l_i, gl.zeros([BLOCK_H, 512], gl.float32, layout=HEADS_O_L), gl.zeros([BLOCK_H, BLOCK_N], gl.float32,
                                                                                      layout=S_L)


@gluon.jit
def _sparse_mla_wgmma_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, FP8: gl.constexpr,
    PART_F16: gl.constexpr = False,
):
    """64-head tiles (17-128 heads) on two warpgroups with wgmma: q and the step's rows in 128-byte-swizzled shared
    memory feed the tensor cores directly (no ldmatrix, no register copy of K/V); S = q.K^T is split by rows
    between the warpgroups, P (in registers, the one exchange a step) is the A operand of P.V, and O [64, 512] is
    split by columns. Same ring of cp.async gathers as the 16-head kernels. fp8_ds_mla: each step's e4m3 chunks
    are dequantized WITH their scale into a bf16 tile (as FlashMLA does; one more bf16 rounding of K/V than the
    16-head kernel's fp16 domain), then the same bf16 products."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups")
    gl.static_assert(BLOCK_H == 64, "wgmma tiles are 64 heads")
    NW: gl.constexpr = gl.num_warps()
    LAT8: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NW, 1], [1, 0])      # [rows, 512] e4m3
    SCALE_L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, NW], [0, 1])     # [4, rows] float32 (chunk, row)
    if FP8:
        gl.static_assert(BLOCK_N == 8 * NW, "fp8_ds_mla wgmma steps are 64 rows (scale copies)")
    LAT: gl.constexpr = LAT8 if FP8 else HEADS_LAT16

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    q_lat, q_rope, lat_ring, rope_ring, scale_ring, scale_stages, kv_deq = _heads_buffers(
        Q, BLOCK_H, BLOCK_N, STAGES, FP8)
    _stage_q_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, HEADS_LAT16, HEADS_ROPE)
    n_start, n_end, slot_row, num_steps, nx_lat, nx_rope, nx_scale = _ring_start(
        SLOTS, t, s, stride_st, rows_per_split, topk, KV, kv_row_stride, num_slots, lat_ring, rope_ring, scale_stages,
        BLOCK_N, STAGES, LAT, HEADS_ROPE, SCALE_L, FP8)
    sl_cols = _slots(slot_row, n_start, n_end, BLOCK_N, HEADS_P_COLS)

    m_i, l_i, acc, zero_s = _heads_state(BLOCK_H, BLOCK_N)
    for i in range(num_steps):
        nx_lat, nx_rope, nx_scale, cur_cols, sl_cols, b = _ring_next(
            i, KV, kv_row_stride, num_slots, slot_row, n_start, n_end, lat_ring, rope_ring, scale_stages, nx_lat,
            nx_rope, nx_scale, sl_cols, BLOCK_N, STAGES, LAT, HEADS_ROPE, SCALE_L, HEADS_P_COLS, FP8)
        m_i, l_i, acc = _heads_step(q_lat, q_rope, lat_ring, rope_ring, scale_ring, kv_deq, b, cur_cols, num_slots,
                                    qk_scale_log2, m_i, l_i, acc, zero_s, FP8)

    async_copy.wait_group(0)
    _store_heads(OUT, LSE, PART_O, PART_LSE, acc, l_i, m_i, t, s, pid_h, num_heads, num_splits, stride_ot, stride_oh,
                 stride_lt, BLOCK_H, SPLIT, PART_F16)


@gluon.jit
def _store_heads(OUT, LSE, PART_O, PART_LSE, acc, l_i, m_i, t, s, pid_h, num_heads, num_splits, stride_ot, stride_oh,
                 stride_lt, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr, PART_F16: gl.constexpr = False):
    """The 64-head kernels' result: out = acc / l (or the split's normalized partial) and lse, O [heads, 512].
    PART_F16: the partial in fp16, each head scaled by a power of two into [2^14, 2^15) (sparse_mla's
    `partial_scale_plane`; the row max spans both warpgroups' columns), columns in `stored_column` order."""
    inv_l, lse2 = _softmax_totals(l_i, m_i, 1.0)
    inv_r = gl.convert_layout(inv_l, HEADS_O_ROWS)
    inv_l = inv_r[:, None]
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=HEADS_O_ROWS)
    hm = (heads < num_heads)[:, None]
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, HEADS_O_L))
    heads_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=HEADS_P_ROWS)
    if SPLIT:
        part = t * num_splits + s
        if PART_F16:
            mul = pow2_into_f16_range(gl.max(gl.abs(acc), 1) * inv_r)
            gl.store(partial_scale_plane(PART_LSE, num_splits, num_heads) + part * num_heads + heads, 1.0 / mul,
                     mask=heads < num_heads)
            # columns into sparse_mla.stored_column's order: c = 16 b + 8 g + 2 q + e -> 16 b + 4 q + 2 g + e; the
            # layout then only renames registers, so each thread's 4 values of a row are one 8-byte store
            v = gl.reshape((acc * (inv_r * mul)[:, None]).to(gl.float16), [BLOCK_H, 32, 2, 4, 2])
            v = gl.convert_layout(gl.reshape(gl.permute(v, [0, 1, 3, 2, 4]), [BLOCK_H, 512]), HEADS_F16_STORE)
            rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, HEADS_F16_STORE))
            stored = gl.arange(0, 512, layout=gl.SliceLayout(0, HEADS_F16_STORE))
            gl.store(PART_O + (part * num_heads + rows[:, None]) * 512 + stored[None, :], v,
                     mask=(rows < num_heads)[:, None])
        else:
            gl.store(PART_O + (part * num_heads + heads[:, None]) * 512 + cols[None, :], acc * inv_l, mask=hm)
        gl.store(PART_LSE + part * num_heads + heads_l, lse2, mask=heads_l < num_heads)
    else:
        o = OUT + t * stride_ot + heads[:, None] * stride_oh + cols[None, :]
        gl.store(o, (acc * inv_l).to(OUT.dtype.element_ty), mask=hm)
        gl.store(LSE + t * stride_lt + heads_l, lse2 * 0.6931471805599453, mask=heads_l < num_heads)


@gluon.jit
def _wgmma_ws_loader(KV, SLOTS, lat_ring, rope_ring, scale_stages, full, empty, t, n_start, n_end, num_steps,
                     num_slots, kv_row_stride, stride_st, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     FP8: gl.constexpr, DIAG: gl.constexpr = 0):
    """The warp-specialized 64-head kernel's loader warpgroup: requests step i's rows into ring slot i % STAGES as
    soon as the consumers have freed it (`empty`); each thread's copies arrive on `full[b]` when they land, so the
    loader never waits on memory and the consumers never issue a gather. (ws_diag 2: no copies, each thread's
    arrival immediate.)"""
    LAT: gl.constexpr = WG_LAT8 if FP8 else WG_LAT16
    ROPE_L: gl.constexpr = WG_ROPE
    SCALE_L: gl.constexpr = WG_SCALE
    slot_row = SLOTS + t * stride_st
    sl_lat, sl_rope, sl_scale = _ring_slots(slot_row, n_start, n_end, BLOCK_N, LAT, ROPE_L, SCALE_L, FP8)
    for i in range(num_steps):
        b = i % STAGES
        mbarrier.wait(empty.index(b), ((i // STAGES) & 1) ^ 1)      # the consumers are done with slot b
        if DIAG != 2:
            sl_lat, sl_rope, sl_scale = _request_step(
                KV, kv_row_stride, num_slots, slot_row, n_start + (i + 1) * BLOCK_N, n_end, lat_ring.index(b),
                rope_ring.index(b), scale_stages.index(b), sl_lat, sl_rope, sl_scale, BLOCK_N, LAT, ROPE_L, SCALE_L,
                FP8)
        async_copy.mbarrier_arrive(full.index(b), increment_count=False)
    async_copy.wait_group(0)


@gluon.jit
def _wgmma_ws_consumer(Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, lat_ring, rope_ring, scale_ring, kv_deq, full,
                       empty, slot_row, n_start, n_end, num_steps, num_slots, qk_scale_log2, t, s, pid_h, num_heads,
                       num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, FP8: gl.constexpr,
                       DIAG: gl.constexpr = 0, PART_F16: gl.constexpr = False, p_tile=None,
                       P_SMEM: gl.constexpr = False, F16_TILE: gl.constexpr = False, POW2: gl.constexpr = True,
                       KEPT_P: gl.constexpr = False, p_flags=None):
    """The two consumer warpgroups: q staged first, while the loader already gathers (NOTES.md v23); then for each
    step, wait for ring slot b, the 64-head step on it (`_heads_step`, as the one-CTA kernel runs it), then `empty[b]`
    back to the loader. (ws_diag 1 / 3: no step and no q; 5: the step without dequantizing.) P_SMEM: P.V's A operand
    from p_tile (`_heads_step`). F16_TILE: q scaled a head (`_stage_q_wgmma`), the scores' scale a head with it
    (`_qk_scale_heads`), the step's fp16 tile as `_heads_step` says. KEPT_P: P against the kept max, the warps' flags in
    p_flags (`_kept_max_softmax`)."""
    gl.static_assert(P_SMEM or not KEPT_P, "P against the kept max takes P through shared memory")
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    if DIAG != 3 and DIAG != 1:
        q_mul = _stage_q_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, HEADS_LAT16,
                               HEADS_ROPE)
        fence_async_shared()                  # (q is read by wgmma through the async proxy)
        gl.thread_barrier()
    else:
        q_mul = 1.0
    qk_scale = _qk_scale_heads(qk_scale_log2, q_mul, F16_TILE, S_L)
    S_COLS: gl.constexpr = gl.SliceLayout(0, S_L)
    COLS: gl.constexpr = S_COLS if P_SMEM else HEADS_P_COLS
    sl_cols = _slots(slot_row, n_start, n_end, BLOCK_N, COLS)
    m_i, l_i, acc, zero_s = _heads_state(BLOCK_H, BLOCK_N, P_SMEM)
    if KEPT_P:
        l_i = _kept_rows(l_i, gl.sum)         # (l per head and warpgroup, `_kept_max_softmax`)
    # (the fp16 tile's last 2^-e, 2^e and e: O is kept in units of the step's 2^e, `_heads_step`)
    unpow_prev = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    pow_prev = gl.full([BLOCK_H], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    e_prev = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, S_L))
    for i in range(num_steps):
        b = i % STAGES
        cur_cols = sl_cols
        sl_cols = _slots(slot_row, n_start + (i + 1) * BLOCK_N, n_end, BLOCK_N, COLS)
        mbarrier.wait(full.index(b), (i // STAGES) & 1)             # every loader thread's copies have landed
        if DIAG != 3 and DIAG != 1:
            pow_h, ratio = None, None
            if F16_TILE and POW2:
                e_prev, pow_h, unpow_h = _stored_pow2(scale_ring, b, gl.SliceLayout(1, S_L))
                ratio = unpow_h * pow_prev        # 2^(e_prev - e): O's rescale
                pow_prev, unpow_prev = pow_h, unpow_h
            m_i, l_i, acc = _heads_step(q_lat, q_rope, lat_ring, rope_ring, scale_ring, kv_deq, b, cur_cols,
                                        num_slots, qk_scale, m_i, l_i, acc, zero_s, FP8, DIAG != 5, p_tile, P_SMEM,
                                        F16_TILE, POW2, pow_h, ratio, KEPT_P, p_flags, i // num_steps)
        gl.thread_barrier()               # both warpgroups are done with slot b (and the bf16 tile)
        mbarrier.arrive(empty.index(b), count=1)
    if P_SMEM:
        l_i = gl.sum(l_i, 1)
        if KEPT_P:                        # (a [heads, 2] sum: another slice of S's layout)
            l_i = gl.convert_layout(l_i, gl.SliceLayout(1, S_L))
        if F16_TILE and POW2:             # (O is in units of the last step's 2^e: O / (l / 2^e) = O * 2^e / l, and
            l_i = l_i * unpow_prev        # lse = (m + e) + log2(l / 2^e) = m + log2(l))
            m_i = m_i + e_prev
        l_i = gl.convert_layout(l_i, HEADS_P_ROWS)
        m_i = gl.convert_layout(m_i, HEADS_P_ROWS)
    _store_heads(OUT, LSE, PART_O, PART_LSE, acc, l_i, m_i, t, s, pid_h, num_heads, num_splits, stride_ot, stride_oh,
                 stride_lt, BLOCK_H, SPLIT, PART_F16)


@gluon.jit
def _qk_scale_heads(qk_scale_log2, q_mul, SCALED: gl.constexpr, L: gl.constexpr):
    """The scores' scale (log2 units): qk_scale_log2 as it is, or -- SCALED, q's latent part times q_mul a head
    (the fp16 tile) -- qk_scale_log2 / q_mul as a [heads, 1] column in the score tile's layout L (exact: q_mul is a
    power of two)."""
    if SCALED:
        return gl.expand_dims(gl.convert_layout(qk_scale_log2 / q_mul, gl.SliceLayout(1, L)), 1)
    else:
        return qk_scale_log2


@gluon.jit
def _p_tile(q_lat, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, P_SMEM: gl.constexpr):
    """P_SMEM: the [heads, rows] tile P goes through as P.V's A operand (8 KB, 128-byte swizzle, in the K/V tile's
    dtype, which q_lat has); otherwise q_lat stands in, never touched."""
    if P_SMEM:
        tile = gl.allocate_shared_memory(q_lat.dtype, [BLOCK_H, BLOCK_N],
                                         gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    else:
        tile = q_lat
    return tile


@gluon.jit
def _p_flags(p_tile, KEPT_P: gl.constexpr):
    """KEPT_P: the consumer warps' flags of a step (`_kept_max_softmax`, [4, 2] int32); otherwise p_tile stands in."""
    if KEPT_P:
        flags = gl.allocate_shared_memory(gl.int32, [4, 2], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:
        flags = p_tile
    return flags


@gluon.jit
def _sparse_mla_wgmma_ws_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, FP8: gl.constexpr,
    DIAG: gl.constexpr = 0, PART_F16: gl.constexpr = False, P_SMEM: gl.constexpr = False,
    KEPT_P: gl.constexpr = False,
):
    """The 64-head wgmma kernel, warp-specialized (NOTES.md v12): a loader warpgroup issues the gathers into the
    ring (cp.async, arriving on an mbarrier when they land) while the two consumer warpgroups run the same step as
    `_sparse_mla_wgmma_sm90_kernel` -- which otherwise issues the next step's copies itself and waits for its own
    at a CTA barrier (ncu, v8: 30% of the stalls at barriers). Same shared memory (one CTA of 12 warps a SM), same
    arithmetic and outputs. DIAG: a timing diagnostic (WS_DIAGNOSTICS 2, 3, 5), wrong results on purpose.
    P_SMEM: P.V's A operand through shared memory, O rescaled lazily (`_heads_step`, NOTES.md v16, v30); KEPT_P with
    it: P against the kept max (`_kept_max_softmax`, v31). The consumers stage q while the loader gathers (NOTES.md
    v23)."""
    gl.static_assert(gl.num_warps() == 8, "two consumer warpgroups (plus a loader warpgroup)")
    gl.static_assert(BLOCK_H == 64, "wgmma tiles are 64 heads")
    gl.static_assert(BLOCK_N == 64, "64-row steps")

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)
    n_start, n_end, num_steps = _split_rows(s, rows_per_split, topk, BLOCK_N)

    q_lat, q_rope, lat_ring, rope_ring, scale_ring, scale_stages, kv_deq = _heads_buffers(
        Q, BLOCK_H, BLOCK_N, STAGES, FP8)
    p_tile = _p_tile(q_lat, BLOCK_H, BLOCK_N, P_SMEM)
    p_flags = _p_flags(p_tile, KEPT_P)
    full, empty = _handover_barriers(STAGES, 4 * 32)      # full[b]: every loader thread's copies have landed
    gl.warp_specialize([
        (_wgmma_ws_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, lat_ring, rope_ring, scale_ring, kv_deq,
                              full, empty, SLOTS + t * stride_st, n_start, n_end, num_steps, num_slots, qk_scale_log2,
                              t, s, pid_h, num_heads, num_splits, stride_qt, stride_qh, stride_ot, stride_oh,
                              stride_lt, BLOCK_H, BLOCK_N, STAGES, SPLIT, FP8, DIAG, PART_F16, p_tile, P_SMEM,
                              False, True, KEPT_P, p_flags)),
        (_wgmma_ws_loader, (KV, SLOTS, lat_ring, rope_ring, scale_stages, full, empty, t, n_start, n_end, num_steps,
                            num_slots, kv_row_stride, stride_st, BLOCK_N, STAGES, FP8, DIAG)),
    ], [4], [WS64_LOADER_REGS])


@gluon.jit
def _wgmma_cv_producer(KV, SLOTS, kv_ring, raw_halves, rope_ring, scale_ring, scale_stages, full, empty, t, n_start,
                       n_end, num_steps, num_slots, kv_row_stride, stride_st, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, DIAG: gl.constexpr = 0, POW2: gl.constexpr = True):
    """The fp8_ds_mla producer warpgroup of `_sparse_mla_wgmma_cv_sm90_kernel`: once the consumers have freed ring slot
    b, it gathers step i's e4m3 rows (cp.async) into the UPPER half of the slot's 16-bit tile, the rope and the scales
    into theirs, waits for its own copies and dequantizes in place. The tile is 8 column blocks of 8 KB (128-byte
    swizzle: 64 columns a block), so chunks 0-1 (columns 0-255) land in the free lower half; chunks 2-3 overwrite the
    raw rows, so every thread reads both first, then a barrier, then the stores. Then `full[b]`. An fp16 tile (POW2) is
    divided by the step's power of two (`_step_pow2`), which the producer leaves in place of chunk 0's scales for the
    consumers. (ws_diag 2: neither gathers nor conversion; 3: no conversion; 4: no gathers; 1: both, the consumers skip
    their step; 6: as 4, converting bytes held in registers instead of the raw rows in shared memory.)"""
    LAT8: gl.constexpr = WG_LAT8
    ROPE_L: gl.constexpr = WG_ROPE
    SCALE_L: gl.constexpr = WG_SCALE
    DQ: gl.constexpr = WG_DQ
    DT: gl.constexpr = kv_ring.dtype
    slot_row = SLOTS + t * stride_st
    sl_lat, sl_rope, sl_scale = _ring_slots(slot_row, n_start, n_end, BLOCK_N, LAT8, ROPE_L, SCALE_L, True)
    if DIAG == 6:
        held = raw_halves.index(1).slice(0, 128, dim=1).load(DQ)      # (whatever the tile holds)
    for i in range(num_steps):
        b = i % STAGES
        mbarrier.wait(empty.index(b), ((i // STAGES) & 1) ^ 1)      # the consumers are done with slot b
        if DIAG == 6:
            # one held chunk of bytes XOR a zero the compilers cannot see (i // num_steps, times c + 1: one
            # instruction per 4 bytes, and the conversion is neither hoisted nor shared between chunks), converted
            # into all four chunks and stored as usual: diagnostic 4 without reading the raw rows from shared memory
            tile = kv_ring.index(b)
            for c in gl.static_range(4):
                zero = gl.full([BLOCK_N, 128], 0, gl.uint8, DQ) + ((i // num_steps) * (c + 1)).to(gl.uint8)
                r = gl.inline_asm_elementwise("xor.b32 $0, $1, $2;", "=r,r,r", [held, zero], dtype=gl.uint8,
                                              is_pure=True, pack=4)
                tile.slice(c * 128, 128, dim=1).store(
                    _scaled(r, scale_ring.index(4 * b + c).load(gl.SliceLayout(1, DQ)), DT))
        elif DIAG != 2:
            raw = raw_halves.index(2 * b + 1)
            if DIAG != 4:
                sl_lat, sl_rope, sl_scale = _request_step(
                    KV, kv_row_stride, num_slots, slot_row, n_start + (i + 1) * BLOCK_N, n_end, raw,
                    rope_ring.index(b), scale_stages.index(b), sl_lat, sl_rope, sl_scale, BLOCK_N, LAT8, ROPE_L,
                    SCALE_L, True)
                async_copy.wait_group(0)
                gl.thread_barrier()            # every producer thread's copies have landed
            if DIAG != 3:
                tile = kv_ring.index(b)
                # chunks 0-1 into the free lower half with the scales as stored -- the fp16 tile's common case, a
                # step within `_step_pow2`'s window (e = 0), whose power of two is reduced beside them
                if DT == gl.float16 and POW2:
                    pow_bits = _step_pow2(scale_stages.index(b))    # (first: its latency hides behind chunks 0-1)
                tile.slice(0, 128, dim=1).store(_dequantized(raw, scale_ring.index(4 * b), 0, DT, DQ))
                tile.slice(128, 128, dim=1).store(_dequantized(raw, scale_ring.index(4 * b + 1), 1, DT, DQ))
                if DT == gl.float16 and POW2:
                    unscale = ((254 << 23) - pow_bits).to(gl.float32, bitcast=True)
                    if pow_bits != 127 << 23:  # a step outside the window (every warp took the same e): chunks 0-1
                        # again from their raw bytes (in the upper half, intact), and the rope part, divided by 2^e
                        tile.slice(0, 128, dim=1).store(_dequantized(raw, scale_ring.index(4 * b), 0, DT, DQ, unscale))
                        tile.slice(128, 128, dim=1).store(
                            _dequantized(raw, scale_ring.index(4 * b + 1), 1, DT, DQ, unscale))
                        _rope_unscaled(rope_ring.index(b), unscale, DQ)
                else:
                    unscale = 1.0
                r2 = raw.slice(256, 128, dim=1).load(DQ)      # (bytes, not values: half the registers)
                r3 = raw.slice(384, 128, dim=1).load(DQ)
                s2 = scale_ring.index(4 * b + 2).load(gl.SliceLayout(1, DQ)) * unscale
                s3 = scale_ring.index(4 * b + 3).load(gl.SliceLayout(1, DQ)) * unscale
                gl.thread_barrier()            # every thread has read the raw rows that chunks 2-3 overwrite
                tile.slice(256, 128, dim=1).store(_scaled(r2, s2, DT))
                tile.slice(384, 128, dim=1).store(_scaled(r3, s3, DT))
                if DT == gl.float16 and POW2:  # (every scale is read by now: 2^e for the consumers, `_stored_pow2`)
                    scale_ring.index(4 * b).store(gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, DQ))
                                                  + pow_bits.to(gl.float32, bitcast=True))
        fence_async_shared()                   # st.shared -> the consumers' wgmma reads
        gl.thread_barrier()
        mbarrier.arrive(full.index(b), count=1)


@gluon.jit
def _sparse_mla_wgmma_cv_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    DIAG: gl.constexpr = 0, PART_F16: gl.constexpr = False, RAW_SWIZZLE: gl.constexpr = True,
    P_SMEM: gl.constexpr = False, F16_TILE: gl.constexpr = False, POW2: gl.constexpr = True,
    KEPT_P: gl.constexpr = False,
):
    """64-head tiles of an fp8_ds_mla cache with the dequantization OFF the consumers (NOTES.md v15): the two consumer
    warpgroups run the 16-bit form of the warp-specialized step on a 2-slot ring of bf16 (F16_TILE: fp16) tiles, while a
    producer warpgroup fills the other slot -- gathers the raw rows into it and dequantizes them in place
    (`_wgmma_cv_producer`). Same shared memory as the bf16 kernel plus the scales (q 72 KB + 2 x (64 + 8) KB); with bf16
    tiles the same arithmetic and outputs as `_sparse_mla_wgmma_ws_sm90_kernel`'s fp8 form. DIAG: a timing diagnostic (1
    the producer alone, 2 the consumers alone, 3 the gathers alone, 4 producer and consumers without the gathers), wrong
    results on purpose. RAW_SWIZZLE: the raw rows' 16-byte pieces XOR the row (within their 128-byte chunk, so the
    in-place order holds), so that the conversion's reads of 8 rows x 64 bytes a warp meet no bank conflict. P_SMEM:
    P.V's A operand through shared memory (`_heads_step`, NOTES.md v16). The consumers stage q while the producer
    gathers (NOTES.md v23). F16_TILE: the ring's tiles and q's latent part in fp16, the producer's dequantization two
    instructions per two values (`_scaled`), each step divided by its power of two (`_step_pow2`; POW2 False, a private
    A/B switch: not, and values beyond 65,504 overflow) -- NOTES.md v28. KEPT_P: P against the kept max
    (`_kept_max_softmax`, NOTES.md v31; the fp16 tile's default since v32, `kept_max_pays`)."""
    gl.static_assert(gl.num_warps() == 8, "two consumer warpgroups (plus a producer warpgroup)")
    gl.static_assert(BLOCK_H == 64, "wgmma tiles are 64 heads")
    gl.static_assert(BLOCK_N == 64, "64-row steps")
    gl.static_assert(STAGES == 2, "two 16-bit tiles (q and two tiles fill the shared memory)")
    gl.static_assert(P_SMEM or not F16_TILE, "the fp16 tile takes P through shared memory")
    RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    RAW8: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 8, [1, 0]) if RAW_SWIZZLE else RAW
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)
    n_start, n_end, num_steps = _split_rows(s, rows_per_split, topk, BLOCK_N)

    q_lat, q_rope, kv_ring, rope_ring, _, _, _ = _heads_buffers(Q, BLOCK_H, BLOCK_N, STAGES, False, F16_TILE)
    raw_halves = kv_ring._reinterpret(gl.uint8, [STAGES * 2, BLOCK_N, 512], RAW8)  # slot b's upper half: 2b + 1
    scale_ring = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], VEC)
    scale_stages = scale_ring._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], RAW)
    p_tile = _p_tile(q_lat, BLOCK_H, BLOCK_N, P_SMEM)
    p_flags = _p_flags(p_tile, KEPT_P)
    full, empty = _handover_barriers(STAGES, 1)
    gl.warp_specialize([
        (_wgmma_ws_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, kv_ring, rope_ring, scale_ring, rope_ring,
                              full, empty, SLOTS + t * stride_st, n_start, n_end, num_steps, num_slots, qk_scale_log2,
                              t, s, pid_h, num_heads, num_splits, stride_qt, stride_qh, stride_ot, stride_oh,
                              stride_lt, BLOCK_H, BLOCK_N, STAGES, SPLIT, False, DIAG, PART_F16, p_tile, P_SMEM,
                              F16_TILE, POW2, KEPT_P, p_flags)),
        (_wgmma_cv_producer, (KV, SLOTS, kv_ring, raw_halves, rope_ring, scale_ring, scale_stages, full, empty, t,
                              n_start, n_end, num_steps, num_slots, kv_row_stride, stride_st, BLOCK_N, STAGES, DIAG,
                              POW2)),
    ], [4], [WS64_CONVERTER_REGS])


@gluon.jit
def _store_columns(OUT, LSE, PART_O, PART_LSE, acc, col0: gl.constexpr, inv_l, lse2, t, s, pid_h, num_heads,
                   num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr,
                   ST_L: gl.constexpr, WITH_LSE: gl.constexpr, V_ORDER: gl.constexpr = False):
    """The rows-as-M kernels' O^T [D, heads], latent columns [col0, col0 + D) -> the split's normalized partial or
    the output (acc * r / l); WITH_LSE also writes the heads' lse (a head with no valid slot: 0 and -inf).
    V_ORDER: acc's rows are a chunk's latent columns in the dual-consumer kernel's order (`_v_order`)."""
    D: gl.constexpr = acc.shape[0]
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, ST_L))
    hm = (heads < num_heads)[None, :]
    dims = gl.arange(0, D, layout=gl.SliceLayout(1, ST_L))
    if V_ORDER:
        dims = _v_column(dims)
    dims = col0 + dims
    if SPLIT:
        part = t * num_splits + s
        gl.store(PART_O + (part * num_heads + heads[None, :]) * 512 + dims[:, None], acc * inv_l[None, :], mask=hm)
        if WITH_LSE:
            gl.store(PART_LSE + part * num_heads + heads, lse2, mask=heads < num_heads)
    else:
        o = OUT + t * stride_ot + heads[None, :] * stride_oh + dims[:, None]
        gl.store(o, (acc * inv_l[None, :]).to(OUT.dtype.element_ty), mask=hm)
        if WITH_LSE:
            gl.store(LSE + t * stride_lt + heads, lse2 * 0.6931471805599453, mask=heads < num_heads)


@gluon.jit
def _store_chunks(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, inv_l, lse2, t, s, pid_h, num_heads, num_splits,
                  stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr, SPLIT: gl.constexpr, ST_L: gl.constexpr,
                  V_ORDER: gl.constexpr = False):
    """The fp8 rows kernels' O^T, four [128, heads] chunk accumulators, through `_store_columns` (the lse once)."""
    _store_columns(OUT, LSE, PART_O, PART_LSE, acc0, 0, inv_l, lse2, t, s, pid_h, num_heads, num_splits, stride_ot,
                   stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, False, V_ORDER)
    _store_columns(OUT, LSE, PART_O, PART_LSE, acc1, 128, inv_l, lse2, t, s, pid_h, num_heads, num_splits, stride_ot,
                   stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, False, V_ORDER)
    _store_columns(OUT, LSE, PART_O, PART_LSE, acc2, 256, inv_l, lse2, t, s, pid_h, num_heads, num_splits, stride_ot,
                   stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, False, V_ORDER)
    _store_columns(OUT, LSE, PART_O, PART_LSE, acc3, 384, inv_l, lse2, t, s, pid_h, num_heads, num_splits, stride_ot,
                   stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, True, V_ORDER)


# The fp8 rows kernels' shared-memory layouts: 16-bit operand tiles (128-byte swizzle), P^T chunks (32-byte), raw
# e4m3 rows (16-byte units XOR the row: no bank conflicts), vectors and plain tiles; q's staging layout (4 warps)
ROWS_SM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
ROWS_SMP = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
ROWS_SM8 = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
ROWS_VEC = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
ROWS_RAW = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
ROWS_QL = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))


@gluon.jit
def _rows_fp8_start(Q, rows_per_split, topk, stride_qt, stride_qh, num_heads, BLOCK_H: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """The fp8 rows kernels' start: this program's head tile, token and split (its rows and steps), and q's buffers,
    which the consumers fill (`_q_fp16_domain`) while the loader already gathers (NOTES.md v23: staged here, before the
    warp partitions start, q's round trip came before the loader's first slot loads). Returns (pid_h, t, s, n_start,
    n_end, num_steps, q_lat, q_rope)."""
    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)
    n_start, n_end, num_steps = _split_rows(s, rows_per_split, topk, BLOCK_N)
    q_lat = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 128], ROWS_SM)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], ROWS_SM)
    return pid_h, t, s, n_start, n_end, num_steps, q_lat, q_rope


@gluon.jit
def _stage_q_rows(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H: gl.constexpr,
                  ST_L: gl.constexpr, K_ORDER: gl.constexpr, ROPE_MUL: gl.constexpr = False):
    """A rows-as-M fp8 consumer warpgroup stages q itself (`_q_fp16_domain`), made visible to its wgmma (async proxy)
    and to all its warps. Returns 1 / q's per-head multiplier in SliceLayout(0, ST_L) (the scores' unscale)."""
    q_mul = _q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, ROWS_QL, K_ORDER,
                           ROPE_MUL)
    q_unscale = gl.convert_layout(1.0 / q_mul, gl.SliceLayout(0, ST_L))
    fence_async_shared()                      # (q is read by wgmma through the async proxy)
    gl.thread_barrier()
    return q_unscale


@gluon.jit
def _sparse_mla_rows_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """<= 16 heads of a bf16/fp16 cache with wgmma, the gathered rows as M (a wgmma's M is 64, the heads are
    only its N): S^T = K.q^T and O^T = V^T.P^T on one warpgroup, both products reading the ring slot straight from
    shared memory (no ldmatrix, far fewer instructions a row than mma.sync), P^T through a 2 KB shared tile. 64-row
    steps and 168 KB of shared memory: one CTA a SM, so it is the default only at small batches (ROWS_CONFIG)."""
    _let_merge_launch(PDL)
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    DT: gl.constexpr = Q.dtype.element_ty
    NW: gl.constexpr = gl.num_warps()
    ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    H_COLS: gl.constexpr = gl.SliceLayout(0, ST_L)      # per head
    N_ROWS: gl.constexpr = gl.SliceLayout(1, ST_L)      # per gathered row
    SM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    SMP: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
    LAT16: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])

    pid_h = gl.program_id(0)
    t = gl.program_id(1).to(gl.int64)
    s = gl.program_id(2)

    q_lat, q_rope = _q_for_wgmma(Q, t, stride_qt, stride_qh, pid_h, num_heads, BLOCK_H, SM, LAT16, ROPE_L)
    lat_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, 512], SM)
    rope_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, 64], SM)
    p_t = gl.allocate_shared_memory(DT, [BLOCK_N, BLOCK_H], SMP)

    n_start, n_end, slot_row, num_steps, nx_lat, nx_rope, nx_scale = _ring_start(
        SLOTS, t, s, stride_st, rows_per_split, topk, KV, kv_row_stride, num_slots, lat_ring, rope_ring, rope_ring,
        BLOCK_N, STAGES, LAT16, ROPE_L, ROPE_L, False)
    sl_rows = _slots(slot_row, n_start, n_end, BLOCK_N, N_ROWS)

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=H_COLS)
    l_acc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST_L)
    acc = gl.zeros([512, BLOCK_H], gl.float32, layout=ST_L)
    zero_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST_L)
    for i in range(num_steps):
        # (the first barrier of _ring_next also guards P^T: every warp is done reading step i - 1's)
        nx_lat, nx_rope, nx_scale, cur_rows, sl_rows, b = _ring_next(
            i, KV, kv_row_stride, num_slots, slot_row, n_start, n_end, lat_ring, rope_ring, rope_ring, nx_lat,
            nx_rope, nx_scale, sl_rows, BLOCK_N, STAGES, LAT16, ROPE_L, ROPE_L, N_ROWS, False)
        fence_async_shared()
        kv = lat_ring.index(b)
        st = warpgroup_mma(kv, q_lat.permute((1, 0)), zero_s)
        st = warpgroup_mma(rope_ring.index(b), q_rope.permute((1, 0)), st)
        p, alpha, m_i, l_acc = _online_softmax(st, cur_rows, num_slots, qk_scale_log2, m_i, l_acc, 0)
        p_t.store(p.to(DT))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(kv.permute((1, 0)), p_t, acc * alpha[None, :])

    async_copy.wait_group(0)
    l_i = gl.sum(l_acc, 0)
    inv_l, lse2 = _softmax_totals(l_i, m_i, 1.0)
    _store_columns(OUT, LSE, PART_O, PART_LSE, acc, 0, inv_l, lse2, t, s, pid_h, num_heads, num_splits, stride_ot,
                   stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, True)


@gluon.jit
def _convert_rows(raw_lat, raw_rope, raw_scales, kv16, rope16, scale_stages, b, r0: gl.constexpr, ROWS: gl.constexpr,
                  DQ: gl.constexpr, ROPE_L: gl.constexpr, SCL: gl.constexpr):
    """Staged raw rows into rows [r0, r0 + ROWS) of ring slot b: the e4m3 bytes converted ONCE to fp16 (exact; the
    scales stay separate), chunk by chunk of 128 values, then rope and the [4 chunks, rows] scales copied beside
    them (a warp a chunk)."""
    dst = kv16.index(b).slice(r0, ROWS, dim=0)
    for c in gl.static_range(4):
        raw = raw_lat.slice(c * 128, 128, dim=1).load(DQ)
        dst.slice(c * 128, 128, dim=1).store(raw.to(gl.float8e4nv, bitcast=True).to(gl.float16))
    rope16.index(b).slice(r0, ROWS, dim=0).store(raw_rope.load(ROPE_L))
    scale_stages.index(b).slice(r0, ROWS, dim=1).store(raw_scales.load(SCL))


@gluon.jit
def _fp8_rows_loader(KV, SLOTS, raw_lat, raw_rope, raw_scale, staged, free, t, n_start, n_end, num_steps, num_slots,
                     kv_row_stride, stride_st, BLOCK_N: gl.constexpr, DIAG: gl.constexpr):
    """The loader warpgroup: only issues the gathers (cp.async), half a step at a time into the two halves of the
    staging buffer, as soon as the converter has freed a half; each thread's copies arrive on `staged[h]` when they
    land (cp.async.mbarrier.arrive), so the loader waits on the converter only, never on memory. A warp's copy is 512
    bytes of ONE row (NOTES.md v11: 64 bytes of eight rows was 8% slower)."""
    HALF: gl.constexpr = BLOCK_N // 2
    LAT: gl.constexpr = WG_LAT8
    ROPE_L: gl.constexpr = WG_ROPE
    SCALE_L: gl.constexpr = WG_SCALE
    slot_row = SLOTS + t * stride_st
    la, ra, sa = _ring_slots(slot_row, n_start, n_end, HALF, LAT, ROPE_L, SCALE_L, True)
    lb, rb, sb = _ring_slots(slot_row, n_start + HALF, n_end, HALF, LAT, ROPE_L, SCALE_L, True)
    if DIAG != 2 and DIAG != 4:                # (ws_diag 2 / 4: no gathers)
        for i in range(num_steps):
            ph = (i & 1) ^ 1
            n_next = n_start + (i + 1) * BLOCK_N
            mbarrier.wait(free.index(0), ph)   # the converter is done with half A of step i - 1
            la, ra, sa = _request_step(KV, kv_row_stride, num_slots, slot_row, n_next, n_end, raw_lat.index(0),
                                       raw_rope.index(0), raw_scale.slice(0, 4, dim=0), la, ra, sa, HALF, LAT,
                                       ROPE_L, SCALE_L, True)
            async_copy.mbarrier_arrive(staged.index(0), increment_count=False)
            mbarrier.wait(free.index(1), ph)
            lb, rb, sb = _request_step(KV, kv_row_stride, num_slots, slot_row, n_next + HALF, n_end,
                                       raw_lat.index(1), raw_rope.index(1), raw_scale.slice(4, 4, dim=0), lb, rb,
                                       sb, HALF, LAT, ROPE_L, SCALE_L, True)
            async_copy.mbarrier_arrive(staged.index(1), increment_count=False)
        async_copy.wait_group(0)


@gluon.jit
def _fp8_rows_converter(raw_lat, raw_rope, raw_scale, kv16, rope16, scale_stages, staged, free, full, empty,
                        num_steps, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, DIAG: gl.constexpr):
    """The converter warpgroup, between loader and consumer: converts each staged half into the fp16 ring slot,
    frees the half for the loader, hands the slot to the consumer. It issues no gather, so a throttled copy queue
    never holds a conversion up (NOTES.md v11: the one producer warpgroup that did both took ~0.5 us a step longer)."""
    NW: gl.constexpr = 4
    HALF: gl.constexpr = BLOCK_N // 2
    ROPE_L: gl.constexpr = WG_ROPE
    DQ: gl.constexpr = WG_DQ
    SCL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])      # [4 chunks, rows] float32
    for i in range(num_steps):
        b = i % STAGES
        mbarrier.wait(empty.index(b), ((i // STAGES) & 1) ^ 1)      # the consumer is done with slot b
        for h in gl.static_range(2):
            if DIAG != 2 and DIAG != 4:
                mbarrier.wait(staged.index(h), i & 1)                # half h of step i has landed
            if DIAG < 2 or DIAG == 4:          # (ws_diag 3: the gathers without the conversion)
                _convert_rows(raw_lat.index(h), raw_rope.index(h), raw_scale.slice(4 * h, 4, dim=0), kv16, rope16,
                              scale_stages, b, h * HALF, HALF, DQ, ROPE_L, SCL)
            if h == 1:
                fence_async_shared()
            gl.thread_barrier()                # every thread is done reading half h's staging (and storing slot b)
            mbarrier.arrive(free.index(h))
        mbarrier.arrive(full.index(b), count=1)


@gluon.jit
def _max_pair(a0, a1, b0, b1):
    """gl.reduce's combine of two maxima at once."""
    return gl.maximum(a0, b0), gl.maximum(a1, b1)


@gluon.jit
def _rows_fp8_state(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, ST_L: gl.constexpr):
    """An fp8 rows consumer's softmax state before its first step: the running max, l per element, the running
    largest chunk scale r (the unit O^T is kept in; the smallest normal float), O^T in four [128, heads] chunks, and
    the zero S^T tile each chunk's product starts from."""
    return (gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ST_L)),
            gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST_L), 1.1754943508222875e-38,
            gl.zeros([128, BLOCK_H], gl.float32, layout=ST_L), gl.zeros([128, BLOCK_H], gl.float32, layout=ST_L),
            gl.zeros([128, BLOCK_H], gl.float32, layout=ST_L), gl.zeros([128, BLOCK_H], gl.float32, layout=ST_L),
            gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=ST_L))


@gluon.jit
def _fp8_rows_consumer(Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, kv16, rope16, scale_ring, p_ts, full, empty,
                       slot_row, n_start, n_end, num_steps, num_slots, qk_scale_log2, t, s, pid_h, num_heads,
                       num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, ST_L: gl.constexpr,
                       DIAG: gl.constexpr):
    """The consumer warpgroup: q staged first, while the loader already gathers (NOTES.md v23); the bf16 rows-as-M
    kernel's products on the fp16 slot (S^T chunk by chunk, each times its scale; P^T per chunk as p * s_c / r, chunk
    c into p_ts[c]), then `empty[b]` back to the converter."""
    N_ROWS: gl.constexpr = gl.SliceLayout(1, ST_L)
    q_unscale = 1.0                           # (ws_diag 1 / 3 run no products: no q)
    if DIAG % 2 == 0:
        q_unscale = _stage_q_rows(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, ST_L, False)
    m_i, l_acc, r_i, acc0, acc1, acc2, acc3, zero_s = _rows_fp8_state(BLOCK_H, BLOCK_N, ST_L)
    sl_rows = _slots(slot_row, n_start, n_end, BLOCK_N, N_ROWS)
    for i in range(num_steps):
        b = i % STAGES
        cur_rows = sl_rows
        sl_rows = _slots(slot_row, n_start + (i + 1) * BLOCK_N, n_end, BLOCK_N, N_ROWS)      # (masks the next step)
        mbarrier.wait(full.index(b), (i // STAGES) & 1)
        if DIAG % 2 == 0:                     # (ws_diag 1 / 3: no products, the producer timed alone)
            kv = kv16.index(b)
            s0 = scale_ring.index(4 * b + 0).load(N_ROWS)
            s1 = scale_ring.index(4 * b + 1).load(N_ROWS)
            s2 = scale_ring.index(4 * b + 2).load(N_ROWS)
            s3 = scale_ring.index(4 * b + 3).load(N_ROWS)
            # S^T chunk by chunk (each chunk's product times its scale), then the rope product on top
            st = warpgroup_mma(kv.slice(0, 128, dim=1), q_lat.index(0).permute((1, 0)), zero_s,
                               use_acc=False) * s0[:, None]
            st += warpgroup_mma(kv.slice(128, 128, dim=1), q_lat.index(1).permute((1, 0)), zero_s,
                                use_acc=False) * s1[:, None]
            st += warpgroup_mma(kv.slice(256, 128, dim=1), q_lat.index(2).permute((1, 0)), zero_s,
                                use_acc=False) * s2[:, None]
            st += warpgroup_mma(kv.slice(384, 128, dim=1), q_lat.index(3).permute((1, 0)), zero_s,
                                use_acc=False) * s3[:, None]
            st = warpgroup_mma(rope16.index(b), q_rope.permute((1, 0)), st * q_unscale[None, :])
            p, alpha, m_i, l_acc = _online_softmax(st, cur_rows, num_slots, qk_scale_log2, m_i, l_acc, 0)
            r_new = gl.maximum(r_i, gl.max(gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3)), 0))
            keep = (alpha * (r_i / r_new))[None, :]
            inv_r = 1.0 / r_new
            p_t0, p_t1, p_t2, p_t3 = _store_p_chunks(p_ts, p, s0, s1, s2, s3, inv_r)
            acc0 = warpgroup_mma(kv.slice(0, 128, dim=1).permute((1, 0)), p_t0, acc0 * keep)
            acc1 = warpgroup_mma(kv.slice(128, 128, dim=1).permute((1, 0)), p_t1, acc1 * keep)
            acc2 = warpgroup_mma(kv.slice(256, 128, dim=1).permute((1, 0)), p_t2, acc2 * keep)
            acc3 = warpgroup_mma(kv.slice(384, 128, dim=1).permute((1, 0)), p_t3, acc3 * keep)
            r_i = r_new
        gl.thread_barrier()                   # every warp's products are done with slot b and with P^T
        mbarrier.arrive(empty.index(b), count=1)
    inv_l, lse2 = _softmax_totals(gl.sum(l_acc, 0), m_i, r_i)
    _store_chunks(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, inv_l, lse2, t, s, pid_h, num_heads, num_splits,
                  stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L)


@gluon.jit
def _store_p_chunks(p_ts, p, s0, s1, s2, s3, inv_r, HALF: gl.constexpr = False):
    """The fp8 rows consumers' P^T into its four chunk tiles, each chunk's probabilities times its scale over r (fp16),
    visible to the async proxy and to every warp before O^T's products read them. Returns the tiles."""
    p_t0, p_t1, p_t2, p_t3 = _p_chunk_stores(p_ts, p, s0, s1, s2, s3, inv_r, HALF)
    fence_async_shared()
    gl.thread_barrier()
    return p_t0, p_t1, p_t2, p_t3


@gluon.jit
def _p_chunk_stores(p_ts, p, s0, s1, s2, s3, inv_r, HALF: gl.constexpr = False):
    """`_store_p_chunks`'s stores alone. HALF (PIPE_H): p converted to fp16 once and each chunk's scale over r rounded
    to fp16 and multiplied in fp16 pairs -- three roundings of P^T instead of one (each 2^-11 relative, at most),
    half the multiplies and conversions of the scores' tile at 16 heads."""
    p_t0 = p_ts[0]
    p_t1 = p_ts[1]
    p_t2 = p_ts[2]
    p_t3 = p_ts[3]
    if HALF:
        p = p.to(gl.float16)
    p_t0.store((p * (s0 * inv_r).to(p.dtype)[:, None]).to(gl.float16))   # (the products in p's precision)
    p_t1.store((p * (s1 * inv_r).to(p.dtype)[:, None]).to(gl.float16))
    p_t2.store((p * (s2 * inv_r).to(p.dtype)[:, None]).to(gl.float16))
    p_t3.store((p * (s3 * inv_r).to(p.dtype)[:, None]).to(gl.float16))
    return p_t0, p_t1, p_t2, p_t3


@gluon.jit
def _handover_barriers(N: gl.constexpr, FILLS: gl.constexpr):
    """The mbarriers of a producer/consumer ring of N slots, `full` (the producer has filled slot b: FILLS arrivals)
    and `empty` (the consumer is done with it: one), initialised and made visible before the partitions start."""
    full = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(N):
        mbarrier.init(full.index(j), count=FILLS)
        mbarrier.init(empty.index(j), count=1)
    fence_async_shared()
    gl.thread_barrier()
    return full, empty


@gluon.jit
def _sparse_mla_rows_fp8_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    DIAG: gl.constexpr = 0, PDL: gl.constexpr = False,
):
    """<= 16 heads of an fp8_ds_mla cache, warp-specialized in three warpgroups (NOTES.md v9, v11): a loader issues
    each step's gathers into a two-half staging buffer, a converter turns each staged half's e4m3 rows once into an
    fp16 ring slot, a consumer runs the rows-as-M wgmma products on the slot (as the bf16/fp16 rows kernel does);
    they hand halves and slots over through mbarriers. Same fp16-domain arithmetic as the mma.sync fp8 kernel.
    218 KB of shared memory: one CTA (12 warps) a SM. The consumer stages q while the loader gathers (NOTES.md
    v23)."""
    _let_merge_launch(PDL)
    gl.static_assert(gl.num_warps() == 4, "one consumer warpgroup (plus a converter and a loader warpgroup)")
    gl.static_assert(BLOCK_N == 64, "64-row steps (the wgmma M)")
    HALF: gl.constexpr = BLOCK_N // 2
    ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    SM: gl.constexpr = ROWS_SM
    SMP: gl.constexpr = ROWS_SMP
    SM8: gl.constexpr = ROWS_SM8
    VEC: gl.constexpr = ROWS_VEC
    RAW: gl.constexpr = ROWS_RAW
    pid_h, t, s, n_start, n_end, num_steps, q_lat, q_rope = _rows_fp8_start(
        Q, rows_per_split, topk, stride_qt, stride_qh, num_heads, BLOCK_H, BLOCK_N)
    kv16 = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, 512], SM)
    rope16 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SM)
    scale_ring = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], VEC)   # stage b: rows 4b .. 4b + 3
    scale_stages = scale_ring._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], RAW)     # the same bytes by stage
    p_t = gl.allocate_shared_memory(gl.float16, [4, BLOCK_N, BLOCK_H], SMP)
    p_ts = (p_t.index(0), p_t.index(1), p_t.index(2), p_t.index(3))
    raw_lat = gl.allocate_shared_memory(gl.uint8, [2, HALF, 512], SM8)          # the staging buffer, in two halves
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, 64], SM)
    raw_scale = gl.allocate_shared_memory(gl.float32, [8, HALF], RAW)           # half h, chunk c: row 4h + c
    full, empty = _handover_barriers(STAGES, 1)
    staged, free = _handover_barriers(2, 4 * 32)          # staged[h]: every loader thread's copies have landed
    gl.warp_specialize([
        (_fp8_rows_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, kv16, rope16, scale_ring, p_ts, full,
                              empty, SLOTS + t * stride_st, n_start, n_end, num_steps, num_slots, qk_scale_log2, t, s,
                              pid_h, num_heads, num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                              BLOCK_H, BLOCK_N, STAGES, SPLIT, ST_L, DIAG)),
        (_fp8_rows_converter, (raw_lat, raw_rope, raw_scale, kv16, rope16, scale_stages, staged, free, full, empty,
                               num_steps, STAGES, BLOCK_N, DIAG)),
        (_fp8_rows_loader, (KV, SLOTS, raw_lat, raw_rope, raw_scale, staged, free, t, n_start, n_end, num_steps,
                            num_slots, kv_row_stride, stride_st, BLOCK_N, DIAG)),
    ], [4, 4], [144, 104])    # registers a thread: converter 144, loader 104, consumer 256 (the 12 warps' 168 each)


# The dual-consumer kernel's register A operands (NOTES.md v17): a consumer warpgroup reads an e4m3 chunk [64 rows,
# 128 bytes] straight from the staging buffer into wgmma's register operand, so no fp16 copy of the rows exists.
# The byte order inside a chunk is free (the same permutation on q's columns, or on O's rows, undoes it), so each
# thread reads bytes that lie together: for K (S^T = K.q^T) 32 contiguous bytes of each of its two rows, for V (O^T =
# V^T.P^T) 4 contiguous bytes of each of its 16 rows. Bases: [row, byte] of the physical chunk.
DUAL_K8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[64, 128]))
DUAL_V8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[[0, 32], [0, 64]], block_bases=[],
    shape=[64, 128]))


@gluon.jit
def _k_order(x):
    """[R, 128] columns of a chunk in physical order p = 32q + 4j + 2h + e -> the order k = 16j + 8h + 2q + e in
    which wgmma's A operand gives them to thread q of a quad (what DUAL_K8 loads, as a register permutation)."""
    R: gl.constexpr = x.shape[0]
    return gl.reshape(gl.permute(gl.reshape(x, [R, 4, 8, 2, 2]), (0, 2, 3, 1, 4)), [R, 128])


@gluon.jit
def _v_order(x):
    """[64 rows, 128 latent] in physical order p = 32w + 4r + 2m + g -> V^T [128, 64 rows] with row dl = 64m + 16w
    + 8g + r: A's rows for warp w, quad row r, row half g, M tile m (what DUAL_V8 loads)."""
    return gl.reshape(gl.permute(gl.reshape(gl.permute(x, (1, 0)), [4, 8, 2, 2, 64]), (2, 0, 3, 1, 4)), [128, 64])


@gluon.jit
def _v_column(dl):
    """The physical latent column (in the chunk) of `_v_order`'s row dl."""
    return 32 * ((dl // 16) % 4) + 4 * (dl % 8) + 2 * (dl // 64) + (dl // 8) % 2


@gluon.jit
def _k_operand(lat, c: gl.constexpr, A_L: gl.constexpr):
    """Chunk c of the staged e4m3 rows as S^T's A operand in registers (fp16, exact; columns in `_k_order`)."""
    raw = lat.slice(c * 128, 128, dim=1).load(DUAL_K8)
    return gl.convert_layout(_k_order(raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)), A_L)


@gluon.jit
def _v_operand(lat, c: gl.constexpr, A_L: gl.constexpr):
    """Chunk c of the staged e4m3 rows as O^T's A operand V^T in registers (fp16, exact; rows in `_v_order`). Each of
    the operand's registers pairs one latent column of two rows, and each load brings 4 columns of one row, so the
    bytes are put in the operand's order first -- one byte permute makes two pairs -- and converted after, by the
    PTX cvt on each pair (the Triton kernel's `_E4M3X4_TO_F16X4`). NOTES.md v33: converted first, Triton's cast and
    then one permute a register pair took 64 more PRMT a consumer step; its cast of the permuted bytes, more still."""
    raw = lat.slice(c * 128, 128, dim=1).load(DUAL_V8)
    return gl.inline_asm_elementwise(_E4M3X4_TO_F16X4, "=r,=r,r", [gl.convert_layout(_v_order(raw), A_L)],
                                     dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _fp8_dual_loader(KV, SLOTS, raw_lat, raw_rope, scale_stages, staged, free, t, n_start, n_end, num_steps,
                     num_slots, kv_row_stride, stride_st, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     DIAG: gl.constexpr, OFFS32: gl.constexpr = False):
    """The dual-consumer kernel's loader warpgroup: step i's gathers (cp.async) into stage i % STAGES as soon as its
    consumer has freed it; each thread's copies arrive on `staged[b]` when they land (OFFS32: `_copy_rows`)."""
    slot_row = SLOTS + t * stride_st
    sl, sr, ss = _ring_slots(slot_row, n_start, n_end, BLOCK_N, WG_LAT8, WG_ROPE, WG_SCALE, True)
    for i in range(num_steps):
        b = i % STAGES
        mbarrier.wait(free.index(b), ((i // STAGES) & 1) ^ 1)
        if DIAG != 2:                          # (ws_diag 2: the consumers alone, on whatever the stages hold)
            sl, sr, ss = _request_step(KV, kv_row_stride, num_slots, slot_row, n_start + (i + 1) * BLOCK_N, n_end,
                                       raw_lat.index(b), raw_rope.index(b), scale_stages.index(b), sl, sr, ss,
                                       BLOCK_N, WG_LAT8, WG_ROPE, WG_SCALE, True, OFFS32)
        async_copy.mbarrier_arrive(staged.index(b), increment_count=False)
    async_copy.wait_group(0)


# the bits of the dual-consumer kernels' PIPE constexpr (`pipe_bits`)
PIPE_S = gl.constexpr(1)       # S^T's products issued async, two at a time
PIPE_O = gl.constexpr(2)       # O^T's products likewise
PIPE_S3 = gl.constexpr(4)      # ... S^T's three at a time (the 8-head tile, consumers at 224 registers)
PIPE_O3 = gl.constexpr(8)      # ... O^T's three at a time (likewise)
PIPE_P = gl.constexpr(16)      # P^T's four tiles re-derived from an opaque 0 each step (`_opaque_view`, NOTES.md v35)
PIPE_F = gl.constexpr(32)      # q's rope part staged times q's multiplier: one multiply a score unscales it (v40)
PIPE_H = gl.constexpr(64)      # P^T's chunk tiles scaled in fp16 pairs: p converted once, each chunk's scale over r
#                                rounded to fp16 and multiplied in; with the kept max l summed after its rare branch
#                                (v40)
PAIRED_LOADER_REGS = gl.constexpr(40)   # the paired kernel's loader (32 spilled 8 bytes); its consumer 256 - this
PAIRED_MAXNREG = 128                     # the paired kernel's registers a thread at launch: two CTAs of 8 warps a SM


@gluon.jit
def _opaque_view(buf, opaque0):
    """The 2-D shared buffer buf, its address re-derived from opaque0 (0, but not to the compiler), so that a wgmma
    descriptor of it is rebuilt where it is used instead of held across a loop (NOTES.md v35: ptxas spilled P^T's
    and reloaded them every step, slow under the loader's traffic)."""
    return buf._reinterpret(buf.dtype, [1, buf.shape[0], buf.shape[1]], buf.type.layout).index(opaque0)


@gluon.jit
def _opaque_p_tiles(p_ts, opaque0):
    """A dual consumer's P^T tiles (`_p_chunks`) through `_opaque_view`; the flags (KEPT_P) as they are."""
    tiles = (_opaque_view(p_ts[0], opaque0), _opaque_view(p_ts[1], opaque0), _opaque_view(p_ts[2], opaque0),
             _opaque_view(p_ts[3], opaque0))
    if len(p_ts) > 4:
        tiles = tiles + (p_ts[4],)
    return tiles


@gluon.jit
def _fp8_dual_step(q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, b, i, num_steps, cur_rows,
                   num_slots, qk_scale_log2, m_i, l_acc, r_i, acc0, acc1, acc2, acc3, zero_s, ST_L: gl.constexpr,
                   PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False):
    """One 64-row step of a dual-consumer warpgroup on stage b: the fp8 rows kernel's arithmetic (S^T chunk by chunk
    times its scale, the rope product, P^T per chunk as p * s_c / r), each product's A operand converted from the
    staged bytes in registers; the scores' max over the rows and the chunk scales' max in ONE reduction across the
    warps (two took two rounds through shared memory). PIPE (bits, NOTES.md v18-v20): S^T's (PIPE_S) / O^T's (PIPE_O)
    products issued async, two at a time, so the next chunk's operand is converted while the last chunk's wgmma runs
    (two operands live, not one); with PIPE_S3 / PIPE_O3 three at a time (`_products_async`); PIPE_P (v35): P^T's
    tiles re-derived from the opaque 0 each step (`_opaque_p_tiles`). KEPT_P (NOTES.md v31):
    P^T against the kept max and r, the reduction across the warps only on flagged steps (`_kept_max_rows`; p_ts then
    carries the warps' flags as its fifth buffer)."""
    N_ROWS: gl.constexpr = gl.SliceLayout(1, ST_L)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ST_L, k_width=2)
    fence_async_shared()                      # (the rope product reads the gathered bytes through the async proxy)
    lat = raw_lat.index(b)
    # (0, but not to the compiler: q's 32 wgmma descriptors are rebuilt each step instead of kept across the
    # loop, where ptxas spilled them)
    opaque0 = i // num_steps
    if PIPE & PIPE_P:                         # (and P^T's four, which ptxas kept across the loop and spilled)
        p_ts = _opaque_p_tiles(p_ts, opaque0)
    s0 = scale_ring.index(4 * b + 0).load(N_ROWS)
    s1 = scale_ring.index(4 * b + 1).load(N_ROWS)
    s2 = scale_ring.index(4 * b + 2).load(N_ROWS)
    s3 = scale_ring.index(4 * b + 3).load(N_ROWS)
    if PIPE & PIPE_S:
        c0, c1, c2, c3 = _products_async(lat, (q_lat, opaque0, zero_s), _s_chunk, A_L, 3 if PIPE & PIPE_S3 else 2)
        st = c0 * s0[:, None] + c1 * s1[:, None] + c2 * s2[:, None] + c3 * s3[:, None]
    else:
        st = warpgroup_mma(_k_operand(lat, 0, A_L), q_lat.index(0 + opaque0).permute((1, 0)), zero_s,
                           use_acc=False) * s0[:, None]
        st += warpgroup_mma(_k_operand(lat, 1, A_L), q_lat.index(1 + opaque0).permute((1, 0)), zero_s,
                            use_acc=False) * s1[:, None]
        st += warpgroup_mma(_k_operand(lat, 2, A_L), q_lat.index(2 + opaque0).permute((1, 0)), zero_s,
                            use_acc=False) * s2[:, None]
        st += warpgroup_mma(_k_operand(lat, 3, A_L), q_lat.index(3 + opaque0).permute((1, 0)), zero_s,
                            use_acc=False) * s3[:, None]
    if PIPE & PIPE_F:                         # (q's rope part staged times q's multiplier)
        st = warpgroup_mma(raw_rope.index(b), q_rope.permute((1, 0)), st)
        s_t = _masked_scores(st, cur_rows, num_slots, (qk_scale_log2 * q_unscale)[None, :], 0)
    else:
        st = warpgroup_mma(raw_rope.index(b), q_rope.permute((1, 0)), st * q_unscale[None, :])
        s_t = _masked_scores(st, cur_rows, num_slots, qk_scale_log2, 0)
    scale_max = gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3))
    if KEPT_P:
        m_i, l_acc, r_new, acc0, acc1, acc2, acc3, p_t0, p_t1, p_t2, p_t3 = _kept_max_rows(
            s_t, scale_max, s0, s1, s2, s3, m_i, l_acc, r_i, acc0, acc1, acc2, acc3, p_ts, (PIPE & PIPE_H) != 0)
        keep = 1.0                            # (O^T rescaled in `_kept_max_rows`, on the steps that move)
    else:
        col_max, col_scale = gl.reduce((s_t, gl.zeros_like(s_t) + scale_max[:, None]), 0, _max_pair)
        p, alpha, m_i, l_acc = _softmax_update(s_t, col_max, m_i, l_acc, 0)
        r_new = gl.maximum(r_i, gl.max(col_scale, 0))
        keep = (alpha * (r_i / r_new))[None, :]
        inv_r = 1.0 / r_new
        p_t0, p_t1, p_t2, p_t3 = _store_p_chunks(p_ts, p, s0, s1, s2, s3, inv_r, (PIPE & PIPE_H) != 0)
    if PIPE & PIPE_O:
        acc0, acc1, acc2, acc3 = _products_async(lat, ((p_t0, p_t1, p_t2, p_t3), (acc0, acc1, acc2, acc3), keep),
                                                 _o_chunk, A_L, 3 if PIPE & PIPE_O3 else 2)
    else:
        acc0 = warpgroup_mma(_v_operand(lat, 0, A_L), p_t0, acc0 * keep)
        acc1 = warpgroup_mma(_v_operand(lat, 1, A_L), p_t1, acc1 * keep)
        acc2 = warpgroup_mma(_v_operand(lat, 2, A_L), p_t2, acc2 * keep)
        acc3 = warpgroup_mma(_v_operand(lat, 3, A_L), p_t3, acc3 * keep)
    return m_i, l_acc, r_new, acc0, acc1, acc2, acc3


@gluon.jit
def _kept_max_rows(s_t, scale_max, s0, s1, s2, s3, m_i, l_acc, r_i, acc0, acc1, acc2, acc3, p_ts,
                   HALF: gl.constexpr = False):
    """The dual consumers' softmax with P^T against the KEPT max and r (NOTES.md v31; `_kept_max_softmax` is the
    64-head form): P^T stored at once as p * s_c / r with p against the running max as it stands, each warp flagging
    a score above it by more than LAZY_TAU or a chunk scale above r times KEPT_R_SLACK (P^T <= 2^8 x 2^4 in fp16), the
    flags carried by P^T's own barrier. Only when a flag is up (the first step; a moved max or scale; uniform over
    the consumer's warpgroup: every thread reads all four) the scores' max and the scales' over the rows are reduced
    across the warps, P^T is stored again behind a second barrier and O^T rescaled. Returns (m, l, r, O^T's four
    chunks, P^T's four tiles). HALF (PIPE_H): P^T scaled in fp16 pairs (`_p_chunk_stores`), l summed after the rare
    branch."""
    H: gl.constexpr = s_t.shape[1]
    p_flags = p_ts[4]
    m_ref = gl.where(m_i == float("-inf"), 0.0, m_i)
    p = gl.exp2(s_t - gl.expand_dims(m_ref, 0))
    p_t0, p_t1, p_t2, p_t3 = _p_chunk_stores(p_ts, p, s0, s1, s2, s3, 1.0 / r_i, HALF)
    up = (s_t > gl.expand_dims(m_i + LAZY_TAU, 0)) | gl.expand_dims(scale_max > r_i * KEPT_R_SLACK, 1)
    p_flags.store(gl.max(gl.max(gl.reshape(up.to(gl.int32), [4, 16, H]), 2), 1))     # (rows 16 w .. 16 w + 15)
    fence_async_shared()
    gl.thread_barrier()
    l_new = l_acc + p
    l_base = l_acc
    m_new = m_i
    r_new = r_i
    if _warp_uniform(gl.max(p_flags.load(ROWS_FLAGS_ALL), 0)) != 0:
        col_max, col_scale = gl.reduce((s_t, gl.zeros_like(s_t) + scale_max[:, None]), 0, _max_pair)
        step_r = gl.max(col_scale, 0)
        r_new = gl.where(step_r > r_i * KEPT_R_SLACK, step_r, r_i)
        p, alpha, m_new, l_new = _lazy_update(s_t, col_max, m_i, l_acc, 0)
        l_base = l_acc * alpha[None, :]
        _p_chunk_stores(p_ts, p, s0, s1, s2, s3, 1.0 / r_new, HALF)
        keep = (alpha * (r_i / r_new))[None, :]
        acc0 = acc0 * keep
        acc1 = acc1 * keep
        acc2 = acc2 * keep
        acc3 = acc3 * keep
        fence_async_shared()
        gl.thread_barrier()
    if HALF:        # (l's sum after the branch: the common path's goes straight into l's registers, not via 8 moves)
        l_new = l_base + p
    return m_new, l_new, r_new, acc0, acc1, acc2, acc3, p_t0, p_t1, p_t2, p_t3


@gluon.jit
def _s_chunk(lat, c: gl.constexpr, A_L: gl.constexpr, ctx):
    """S^T's product of chunk c issued async (ctx: q's chunk tiles, the opaque 0 that indexes them, S^T's zero
    accumulator); q's descriptor is built beside its wgmma (v17: kept across the loop, ptxas spilled them)."""
    q_lat, opaque0, zero_s = ctx
    k = _k_operand(lat, c, A_L)
    return warpgroup_mma(k, q_lat.index(c + opaque0).permute((1, 0)), zero_s, use_acc=False, is_async=True), k


@gluon.jit
def _o_chunk(lat, c: gl.constexpr, A_L: gl.constexpr, ctx):
    """O^T's product of chunk c issued async (ctx: the four P^T tiles, the four O^T chunks, keep), the chunk rescaled
    by keep first."""
    p_ts, accs, keep = ctx
    v = _v_operand(lat, c, A_L)
    return warpgroup_mma(v, p_ts[c], accs[c] * keep, is_async=True), v


@gluon.jit
def _products_async(lat, ctx, chunk: gl.constexpr, A_L: gl.constexpr, DEPTH: gl.constexpr):
    """One side's four chunk products of a dual-consumer step (`_s_chunk` or `_o_chunk`) issued async, DEPTH (2 or
    3) in flight: chunk c + DEPTH's operand is converted from the staged bytes while chunk c's wgmma runs. Returns
    the four results."""
    t0, a0 = chunk(lat, 0, A_L, ctx)
    t1, a1 = chunk(lat, 1, A_L, ctx)
    if DEPTH == 3:
        t2, a2 = chunk(lat, 2, A_L, ctx)
    r0, a0 = warpgroup_mma_wait(DEPTH - 1, deps=[t0, a0])
    if DEPTH == 2:
        t2, a2 = chunk(lat, 2, A_L, ctx)
    else:
        t3, a3 = chunk(lat, 3, A_L, ctx)
    r1, a1 = warpgroup_mma_wait(DEPTH - 1, deps=[t1, a1])
    if DEPTH == 2:
        t3, a3 = chunk(lat, 3, A_L, ctx)
    r2, a2 = warpgroup_mma_wait(1, deps=[t2, a2])
    r3, a3 = warpgroup_mma_wait(0, deps=[t3, a3])
    return r0, r1, r2, r3


@gluon.jit
def _fp8_dual_steps(q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, staged, free, slot_row, n_start,
                    n_end, num_steps, first, g, num_slots, qk_scale_log2, BLOCK_H: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ST_L: gl.constexpr, DIAG: gl.constexpr,
                    PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False, STRIDE: gl.constexpr = 2):
    """A dual consumer's steps first, first + 2, ... of one split's rows (`_fp8_dual_step`; step i in the ring's
    stage (g + i) % STAGES, g the steps the ring carried before), each stage freed once every warp is done with it.
    KEPT_P: as `_fp8_dual_step`; STRIDE 1: every step (the paired kernel's one consumer). Returns its softmax state
    (m, l, r, O^T in four chunks)."""
    N_ROWS: gl.constexpr = gl.SliceLayout(1, ST_L)
    m_i, l_acc, r_i, acc0, acc1, acc2, acc3, zero_s = _rows_fp8_state(BLOCK_H, BLOCK_N, ST_L)
    sl_rows = _slots(slot_row, n_start + first * BLOCK_N, n_end, BLOCK_N, N_ROWS)
    for i in range(first, num_steps, STRIDE):
        gi = g + i
        b = gi % STAGES
        cur_rows = sl_rows
        sl_rows = _slots(slot_row, n_start + (i + STRIDE) * BLOCK_N, n_end, BLOCK_N, N_ROWS)
        mbarrier.wait(staged.index(b), (gi // STAGES) & 1)
        if DIAG != 3:                         # (ws_diag 3: the gathers alone)
            m_i, l_acc, r_i, acc0, acc1, acc2, acc3 = _fp8_dual_step(
                q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, b, i, num_steps, cur_rows, num_slots,
                qk_scale_log2, m_i, l_acc, r_i, acc0, acc1, acc2, acc3, zero_s, ST_L, PIPE, KEPT_P)
        gl.thread_barrier()                   # every warp is done with stage b and with P^T
        mbarrier.arrive(free.index(b), count=1)
    return m_i, gl.sum(l_acc, 0), r_i, acc0, acc1, acc2, acc3


@gluon.jit
def _raw_ring(STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The dual-consumer kernels' ring of raw fp8_ds_mla rows: STAGES stages of 512 e4m3 bytes (XOR-swizzled 16-byte
    units), 64 bf16 rope values (wgmma's swizzle) and 4 scales a row -- the scales as [STAGES * 4, rows] (stage b:
    rows 4b .. 4b + 3, the consumers' view) and the same bytes as [STAGES, 4, rows] (the loader's)."""
    raw_lat = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], ROWS_SM8)
    raw_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], ROWS_SM)
    scale_ring = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], ROWS_VEC)
    return raw_lat, raw_rope, scale_ring, scale_ring._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], ROWS_RAW)


@gluon.jit
def _p_chunk(BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr):
    """One chunk's P^T [rows, heads], O^T's B operand: 16 heads as they are; 8 heads (16-byte rows, below the
    smallest swizzle) stored as P [heads, rows] and read transposed."""
    if BLOCK_H == 8:
        return gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], ROWS_SM).permute((1, 0))
    else:
        return gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_H], ROWS_SMP)


@gluon.jit
def _p_chunks(BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, KEPT_P: gl.constexpr = False):
    """A dual consumer's four P^T chunks (`_p_chunk`); KEPT_P: and its four warps' flags (`_kept_max_rows`)."""
    chunks = (_p_chunk(BLOCK_N, BLOCK_H), _p_chunk(BLOCK_N, BLOCK_H), _p_chunk(BLOCK_N, BLOCK_H),
              _p_chunk(BLOCK_N, BLOCK_H))
    if KEPT_P:
        chunks = chunks + (gl.allocate_shared_memory(gl.int32, [4], ROWS_VEC),)
    return chunks


@gluon.jit
def _state_stage(num_steps, STAGES: gl.constexpr):
    """The stage whose bytes take consumer 1's state at the end: its last stage -- its last step is the largest odd
    one; the stage's next step would be STAGES later, past the end, and its step before was freed before the loader
    refilled it; with no step of its own, stage 1 (num_steps <= 1: never filled)."""
    last = num_steps - 1 - num_steps % 2
    return gl.where(num_steps >= 2, last % STAGES, 1)


@gluon.jit
def _hand_state(merge_acc, merge_vec, base, acc0, acc1, acc2, acc3, m_i, l_i, r_i):
    """Leave a consumer's softmax state (O^T in units of r, l, m) at merge_acc rows base .. base + 3 and merge_vec
    rows 0 .. 2 for `_fold_state`, every warp's stores done."""
    merge_acc.index(base + 0).store(acc0)
    merge_acc.index(base + 1).store(acc1)
    merge_acc.index(base + 2).store(acc2)
    merge_acc.index(base + 3).store(acc3)
    merge_vec.index(0).store(m_i)
    merge_vec.index(1).store(l_i)
    merge_vec.index(2).store(gl.zeros_like(l_i) + r_i)
    gl.thread_barrier()


@gluon.jit
def _fold_state(acc0, acc1, acc2, acc3, m_i, l_i, r_i, merge_acc, merge_vec, base, ST_L: gl.constexpr):
    """Merge into this consumer's softmax state the one the other left (`_hand_state`)."""
    H_COLS: gl.constexpr = gl.SliceLayout(0, ST_L)
    m_o = merge_vec.index(0).load(H_COLS)
    l_o = merge_vec.index(1).load(H_COLS)
    r_o = gl.max(merge_vec.index(2).load(H_COLS), 0)
    m_new = gl.maximum(m_i, m_o)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    a_mine = gl.exp2(m_i - m_safe)
    a_other = gl.exp2(m_o - m_safe)
    r_new = gl.maximum(r_i, r_o)
    k_mine = (a_mine * (r_i / r_new))[None, :]
    k_other = (a_other * (r_o / r_new))[None, :]
    acc0 = acc0 * k_mine + merge_acc.index(base + 0).load(ST_L) * k_other
    acc1 = acc1 * k_mine + merge_acc.index(base + 1).load(ST_L) * k_other
    acc2 = acc2 * k_mine + merge_acc.index(base + 2).load(ST_L) * k_other
    acc3 = acc3 * k_mine + merge_acc.index(base + 3).load(ST_L) * k_other
    return acc0, acc1, acc2, acc3, m_new, l_i * a_mine + l_o * a_other, r_new


@gluon.jit
def _stage_q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, q_unscale, BLOCK_H: gl.constexpr,
                         H_COLS: gl.constexpr, ROPE_MUL: gl.constexpr = False):
    """A dual or paired consumer's q staged in the fp16 domain (`_q_fp16_domain`) with its per-head unscale, visible to
    the warpgroup's wgmma (async proxy) and to every warp of it."""
    q_mul = _q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, BLOCK_H, ROWS_QL, True,
                           ROPE_MUL)
    q_unscale.store(gl.convert_layout(1.0 / q_mul, H_COLS))
    fence_async_shared()                      # (q is read by wgmma through the async proxy)
    gl.thread_barrier()


@gluon.jit
def _fp8_dual_consumer(Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts,
                       merge_acc, merge_vec, staged, free, merged, q_ready, slot_row, n_start, n_end, num_steps,
                       num_slots, qk_scale_log2, t, s, pid_h, num_heads, num_splits, stride_qt, stride_qh, stride_ot,
                       stride_oh, stride_lt, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       SPLIT: gl.constexpr, ST_L: gl.constexpr, WG: gl.constexpr, DIAG: gl.constexpr,
                       PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False):
    """Consumer warpgroup WG of the dual-consumer kernel: warpgroup 0 stages q (and q_unscale) while the loader already
    gathers and tells warpgroup 1 through `q_ready` (NOTES.md v23); steps WG, WG + 2, ... (`_fp8_dual_step`) with a
    softmax state of its own; then warpgroup 1 hands its state to warpgroup 0 through a stage's bytes
    (`_state_stage`), and warpgroup 0 merges the two and writes the result. KEPT_P: P^T against the kept max
    (`_kept_max_rows`, NOTES.md v31; the default of both tiles since v36)."""
    H_COLS: gl.constexpr = gl.SliceLayout(0, ST_L)
    if DIAG != 3:                             # (ws_diag 3 runs no products: no q)
        if WG == 0:
            _stage_q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, q_unscale, BLOCK_H,
                                 H_COLS, (PIPE & PIPE_F) != 0)
            mbarrier.arrive(q_ready, count=1)
        else:
            mbarrier.wait(q_ready, 0)
    q_unscale = q_unscale.load(H_COLS)
    m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _fp8_dual_steps(
        q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, staged, free, slot_row, n_start, n_end,
        num_steps, WG, 0, num_slots, qk_scale_log2, BLOCK_H, BLOCK_N, STAGES, ST_L, DIAG, PIPE, KEPT_P)
    base = (merge_acc.shape[0] // STAGES) * _state_stage(num_steps, STAGES)    # (merge_acc's tiles of that stage)
    if WG > 0:
        _hand_state(merge_acc, merge_vec, base, acc0, acc1, acc2, acc3, m_i, l_i, r_i)
        mbarrier.arrive(merged, count=1)
    else:
        mbarrier.wait(merged, 0)
        acc0, acc1, acc2, acc3, m_i, l_i, r_i = _fold_state(acc0, acc1, acc2, acc3, m_i, l_i, r_i, merge_acc,
                                                            merge_vec, base, ST_L)
        inv_l, lse2 = _softmax_totals(l_i, m_i, r_i)
        _store_chunks(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, inv_l, lse2, t, s, pid_h, num_heads,
                      num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, True)


@gluon.jit
def _sparse_mla_rows_fp8_dual_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    DIAG: gl.constexpr = 0, PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False, STAMPS=None,
):
    """<= 16 heads of an fp8_ds_mla cache on two consumer warpgroups and a loader (NOTES.md v17): no converter and no
    fp16 copy of the rows. Each consumer converts the staged e4m3 bytes it needs straight into wgmma's register A
    operand (S^T's K and O^T's V^T, each byte twice), runs every other 64-row step with a softmax state of its own,
    and the two states are merged at the end. 4 stages of raw rows (41 KB each) instead of v11's one staging buffer
    and two fp16 slots: ~200 KB of shared memory, one CTA (12 warps) a SM. 16- or 8-head tiles (P^T stored as P
    [heads, rows] and read transposed at 8); the 8-head tile also runs persistent,
    `_sparse_mla_rows_fp8_persistent_sm90_kernel` (NOTES.md v18; not a default since v36). Consumer 0 stages q while
    the loader gathers
    (NOTES.md v23). KEPT_P: P^T against the kept max (`_kept_max_rows`, NOTES.md v31). STAMPS: the wave stamps
    (WAVE_STAMPS), a diagnostic."""
    _wave_start(STAMPS)
    gl.static_assert(gl.num_warps() == 4, "each of the two consumers is one warpgroup (plus a loader warpgroup)")
    gl.static_assert(BLOCK_N == 64, "64-row steps (the wgmma M)")
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 8, "16- or 8-head tiles (wgmma N = 16 or 8)")
    gl.static_assert(STAGES % 2 == 0, "an even number of stages: each consumer's steps keep to stages of their own")
    ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    VEC: gl.constexpr = ROWS_VEC
    RAW: gl.constexpr = ROWS_RAW
    pid_h, t, s, n_start, n_end, num_steps, q_lat, q_rope = _rows_fp8_start(
        Q, rows_per_split, topk, stride_qt, stride_qh, num_heads, BLOCK_H, BLOCK_N)
    q_unscale = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)   # (a worker partition takes no tensor)
    raw_lat, raw_rope, scale_ring, scale_stages = _raw_ring(STAGES, BLOCK_N)
    merge_acc = raw_lat._reinterpret(gl.float32, [STAGES * (64 // BLOCK_H), 128, BLOCK_H], RAW)   # a stage: 32 KB
    merge_vec = gl.allocate_shared_memory(gl.float32, [3, BLOCK_H], VEC)
    p_a = _p_chunks(BLOCK_N, BLOCK_H, KEPT_P)
    p_b = _p_chunks(BLOCK_N, BLOCK_H, KEPT_P)
    merged = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(merged, count=1)
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(q_ready, count=1)           # consumer 0 has staged q
    staged, free = _handover_barriers(STAGES, 4 * 32)     # staged[b]: every loader thread's copies have landed
    slot_row = SLOTS + t * stride_st
    gl.warp_specialize([
        (_fp8_dual_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring,
                              p_a, merge_acc, merge_vec, staged, free, merged, q_ready, slot_row, n_start, n_end,
                              num_steps, num_slots, qk_scale_log2, t, s, pid_h, num_heads, num_splits, stride_qt,
                              stride_qh, stride_ot, stride_oh, stride_lt, BLOCK_H, BLOCK_N, STAGES, SPLIT, ST_L, 0,
                              DIAG, PIPE, KEPT_P)),
        (_fp8_dual_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring,
                              p_b, merge_acc, merge_vec, staged, free, merged, q_ready, slot_row, n_start, n_end,
                              num_steps, num_slots, qk_scale_log2, t, s, pid_h, num_heads, num_splits, stride_qt,
                              stride_qh, stride_ot, stride_oh, stride_lt, BLOCK_H, BLOCK_N, STAGES, SPLIT, ST_L, 1,
                              DIAG, PIPE, KEPT_P)),
        (_fp8_dual_loader, (KV, SLOTS, raw_lat, raw_rope, scale_stages, staged, free, t, n_start, n_end,
                            num_steps, num_slots, kv_row_stride, stride_st, BLOCK_N, STAGES, DIAG)),
    ], [4, 4], [224, 56] if PIPE & PIPE_O else [208, 88])
    _stamp(STAMPS, 13, GLOBAL=True)
    # registers a thread: consumers 208 each, loader 88 (the 12 warps' 168 each); with O^T's products pipelined the
    # 16-head consumers need 224 (208 spill, NOTES.md v18 Next), the loader fits 56 (v17's three-consumer trial)


@gluon.jit
def _fp8_paired_consumer(Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts,
                         staged, free, slot_row, n_start, n_end, num_steps, num_slots, qk_scale_log2, t, s, pid_h,
                         num_heads, num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                         BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                         ST_L: gl.constexpr, DIAG: gl.constexpr, PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False):
    """The paired kernel's one consumer warpgroup: stages q, runs every step (`_fp8_dual_step`) and writes the
    result -- no state to hand over."""
    H_COLS: gl.constexpr = gl.SliceLayout(0, ST_L)
    if DIAG != 3:                             # (ws_diag 3 runs no products: no q)
        _stage_q_fp16_domain(Q, t, stride_qt, stride_qh, pid_h, num_heads, q_lat, q_rope, q_unscale, BLOCK_H, H_COLS,
                             (PIPE & PIPE_F) != 0)
    q_unscale = q_unscale.load(H_COLS)
    m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _fp8_dual_steps(
        q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, staged, free, slot_row, n_start, n_end,
        num_steps, 0, 0, num_slots, qk_scale_log2, BLOCK_H, BLOCK_N, STAGES, ST_L, DIAG, PIPE, KEPT_P, 1)
    inv_l, lse2 = _softmax_totals(l_i, m_i, r_i)
    _store_chunks(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, inv_l, lse2, t, s, pid_h, num_heads,
                  num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, True)


@gluon.jit
def _sparse_mla_rows_fp8_paired_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    DIAG: gl.constexpr = 0, PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False, OFFS32: gl.constexpr = False,
    STAMPS=None, PDL: gl.constexpr = False,
):
    """The dual-consumer kernel's step on ONE consumer warpgroup and a loader, half its shared memory (2 stages of raw
    rows), built for 128 registers a thread (`launch`: maxnreg) so that TWO CTAs share a SM: a program's start
    (its first slot indices and rows) and end (the last steps, the store) overlap the other CTA's steps instead of
    leaving the SM's gathers idle (NOTES.md v35 / v37: ~5-7 us a program), and there is no state to merge. The
    consumer at 256 - the loader's registers (setmaxnreg). OFFS32 (tile key "offs32", NOTES.md v40-v41): the
    loader's row offsets in 32 bits (`_copy_rows`; `launch` refuses True for a cache of 2^31 elements or more, and
    "auto", the paired 16-head default's, takes it where the cache allows). STAMPS: the wave stamps (WAVE_STAMPS),
    a diagnostic. PDL: let the next grid launch from this one's start (`_let_merge_launch`; the tail split's whole
    tokens, NOTES.md v44)."""
    _wave_start(STAMPS)
    _let_merge_launch(PDL)
    gl.static_assert(gl.num_warps() == 4, "one consumer warpgroup (plus a loader warpgroup)")
    gl.static_assert(BLOCK_N == 64, "64-row steps (the wgmma M)")
    gl.static_assert(BLOCK_H == 16 or BLOCK_H == 8, "16- or 8-head tiles (wgmma N = 16 or 8)")
    ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    pid_h, t, s, n_start, n_end, num_steps, q_lat, q_rope = _rows_fp8_start(
        Q, rows_per_split, topk, stride_qt, stride_qh, num_heads, BLOCK_H, BLOCK_N)
    q_unscale = gl.allocate_shared_memory(gl.float32, [BLOCK_H], ROWS_VEC)
    raw_lat, raw_rope, scale_ring, scale_stages = _raw_ring(STAGES, BLOCK_N)
    p_ts = _p_chunks(BLOCK_N, BLOCK_H, KEPT_P)
    staged, free = _handover_barriers(STAGES, 4 * 32)     # staged[b]: every loader thread's copies have landed
    slot_row = SLOTS + t * stride_st
    gl.warp_specialize([
        (_fp8_paired_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, q_unscale, raw_lat, raw_rope,
                                scale_ring, p_ts, staged, free, slot_row, n_start, n_end, num_steps, num_slots,
                                qk_scale_log2, t, s, pid_h, num_heads, num_splits, stride_qt, stride_qh, stride_ot,
                                stride_oh, stride_lt, BLOCK_H, BLOCK_N, STAGES, SPLIT, ST_L, DIAG, PIPE, KEPT_P)),
        (_fp8_dual_loader, (KV, SLOTS, raw_lat, raw_rope, scale_stages, staged, free, t, n_start, n_end,
                            num_steps, num_slots, kv_row_stride, stride_st, BLOCK_N, STAGES, DIAG, OFFS32)),
    ], [4], [PAIRED_LOADER_REGS])
    _stamp(STAMPS, 13, GLOBAL=True)


@gluon.jit
def _item_rows(item, num_items, num_splits, rows_per_split, topk, SLOTS, stride_st, BLOCK_N: gl.constexpr):
    """Work item `item` of a persistent program (token item // num_splits, split item % num_splits): its token, split,
    rows [n_start, n_end), steps and slot row; an item past the end gets no rows (n_end = n_start, no steps)."""
    t = (item // num_splits).to(gl.int64)
    s = item % num_splits
    n_start, n_end, num_steps = _split_rows(s, rows_per_split, topk, BLOCK_N)
    n_end = gl.where(item < num_items, n_end, n_start)
    return t, s, n_start, n_end, gl.where(item < num_items, num_steps, 0), SLOTS + t * stride_st


@gluon.jit
def _fp8_persistent_loader(KV, SLOTS, raw_lat, raw_rope, scale_stages, staged, free, num_items, num_splits,
                           rows_per_split, topk, num_slots, kv_row_stride, stride_st, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, DIAG: gl.constexpr):
    """The persistent kernel's loader warpgroup: the steps of this program's items one after another into the ring
    (global step g into stage g % STAGES), the next item's first slot indices loaded during the last step of this
    one, so the ring never drains between items."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    _, _, n_start, n_end, _, slot_row = _item_rows(pid, num_items, num_splits, rows_per_split, topk, SLOTS,
                                                   stride_st, BLOCK_N)
    sl, sr, ss = _ring_slots(slot_row, n_start, n_end, BLOCK_N, WG_LAT8, WG_ROPE, WG_SCALE, True)
    g = 0
    for item in range(pid, num_items, G):
        _, _, n_start, n_end, num_steps, slot_row = _item_rows(item, num_items, num_splits, rows_per_split, topk,
                                                               SLOTS, stride_st, BLOCK_N)
        _, _, n2_start, n2_end, _, slot_row2 = _item_rows(item + G, num_items, num_splits, rows_per_split, topk,
                                                          SLOTS, stride_st, BLOCK_N)
        for i in range(num_steps):
            b = g % STAGES
            mbarrier.wait(free.index(b), ((g // STAGES) & 1) ^ 1)
            if DIAG != 2:                      # (ws_diag 2: the consumers alone, on whatever the stages hold)
                last = i + 1 == num_steps      # (then the slot indices loaded next are the next item's first)
                sl, sr, ss = _request_step(KV, kv_row_stride, num_slots, gl.where(last, slot_row2, slot_row),
                                           gl.where(last, n2_start, n_start + (i + 1) * BLOCK_N),
                                           gl.where(last, n2_end, n_end), raw_lat.index(b), raw_rope.index(b),
                                           scale_stages.index(b), sl, sr, ss, BLOCK_N, WG_LAT8, WG_ROPE, WG_SCALE,
                                           True)
            async_copy.mbarrier_arrive(staged.index(b), increment_count=False)
            g += 1
    async_copy.wait_group(0)


@gluon.jit
def _fp8_persistent_consumer(Q, OUT, LSE, PART_O, PART_LSE, q_lat, q_rope, raw_lat, raw_rope, scale_ring, p_ts,
                             merge_acc, merge_vec, staged, free, handed, taken, SLOTS, num_items, num_splits,
                             rows_per_split, topk, num_slots, qk_scale_log2, num_heads, stride_qt, stride_qh,
                             stride_st, stride_ot, stride_oh, stride_lt, BLOCK_H: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, ST_L: gl.constexpr,
                             WG: gl.constexpr, DIAG: gl.constexpr, PIPE: gl.constexpr = 0,
                             KEPT_P: gl.constexpr = False):
    """Consumer warpgroup WG of the persistent kernel: for each item of this program, q staged into its own buffers,
    the item's steps whose global index has WG's parity (`_fp8_dual_step`, a softmax state per item), then
    warpgroup 1 hands its state to warpgroup 0 through `merge_acc` (handed / taken, one phase an item) and
    warpgroup 0 merges the two and writes the item's result while warpgroup 1 goes on with the next item. KEPT_P: P^T
    against the kept max (`_kept_max_rows`, NOTES.md v31; not a default of the 8-head tiles)."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    g = 0
    phase = 0
    for item in range(pid, num_items, G):
        t, s, n_start, n_end, num_steps, slot_row = _item_rows(item, num_items, num_splits, rows_per_split, topk,
                                                               SLOTS, stride_st, BLOCK_N)
        q_unscale = _stage_q_rows(Q, t, stride_qt, stride_qh, 0, num_heads, q_lat, q_rope, BLOCK_H, ST_L, True,
                                  (PIPE & PIPE_F) != 0)
        m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _fp8_dual_steps(     # (its steps: global index g + i of WG's parity)
            q_lat, q_rope, q_unscale, raw_lat, raw_rope, scale_ring, p_ts, staged, free, slot_row, n_start, n_end,
            num_steps, (g + WG) % 2, g, num_slots, qk_scale_log2, BLOCK_H, BLOCK_N, STAGES, ST_L, DIAG, PIPE,
            KEPT_P)
        g += num_steps
        if WG == 1:
            mbarrier.wait(taken, phase ^ 1)   # warpgroup 0 has read the previous item's state
            _hand_state(merge_acc, merge_vec, 0, acc0, acc1, acc2, acc3, m_i, l_i, r_i)
            mbarrier.arrive(handed, count=1)
        else:
            mbarrier.wait(handed, phase)
            acc0, acc1, acc2, acc3, m_i, l_i, r_i = _fold_state(acc0, acc1, acc2, acc3, m_i, l_i, r_i, merge_acc,
                                                                merge_vec, 0, ST_L)
            gl.thread_barrier()
            mbarrier.arrive(taken, count=1)
            inv_l, lse2 = _softmax_totals(l_i, m_i, r_i)
            _store_chunks(OUT, LSE, PART_O, PART_LSE, acc0, acc1, acc2, acc3, inv_l, lse2, t, s, 0, num_heads,
                          num_splits, stride_ot, stride_oh, stride_lt, BLOCK_H, SPLIT, ST_L, True)
        phase ^= 1


@gluon.jit
def _sparse_mla_rows_fp8_persistent_sm90_kernel(
    Q, KV, SLOTS, OUT, LSE, PART_O, PART_LSE,
    qk_scale_log2, num_slots, num_heads, topk, rows_per_split, num_splits,
    stride_qt, stride_qh, kv_row_stride, stride_st, stride_ot, stride_oh, stride_lt, num_items,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    DIAG: gl.constexpr = 0, PIPE: gl.constexpr = 0, KEPT_P: gl.constexpr = False,
):
    """<= 8 heads of an fp8_ds_mla cache: the dual-consumer kernel's 8-head tile (wgmma N = 8; P stored [heads,
    rows] and read transposed), persistent (NOTES.md v18). One program a SM walks the work items (token, split) p,
    p + G, ...; the loader streams every item's steps through one ring and the consumers hand over at item ends, so
    the ring's fill and the last steps' products are not paid once per item (H200, v18 calls 2-3 at 8 heads x 512
    tokens: one item a program 218-220 us, its gathers alone 188; persistent 212, its gathers alone 180 -- the
    gather ceiling -- and its consumers alone 164). Each consumer stages q itself (its own buffers); warpgroup 1's
    state goes to warpgroup 0 through a buffer of its own (not a stage: the ring goes on). ~207 KB of shared
    memory; launched on min(items, SMs) programs (`launch`). KEPT_P: P^T against the kept max (`_kept_max_rows`,
    NOTES.md v31)."""
    gl.static_assert(gl.num_warps() == 4, "each of the two consumers is one warpgroup (plus a loader warpgroup)")
    gl.static_assert(BLOCK_N == 64, "64-row steps (the wgmma M)")
    gl.static_assert(BLOCK_H == 8, "the 8-head tile (wgmma N = 8; <= 8 heads)")
    gl.static_assert(STAGES >= 3, "two stages in the consumers' hands, at least one in flight")
    ST_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    SM: gl.constexpr = ROWS_SM
    VEC: gl.constexpr = ROWS_VEC
    RAW: gl.constexpr = ROWS_RAW
    q_lat0 = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 128], SM)
    q_rope0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], SM)
    q_lat1 = gl.allocate_shared_memory(gl.float16, [4, BLOCK_H, 128], SM)
    q_rope1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], SM)
    raw_lat, raw_rope, scale_ring, scale_stages = _raw_ring(STAGES, BLOCK_N)
    merge_acc = gl.allocate_shared_memory(gl.float32, [4, 128, BLOCK_H], RAW)
    merge_vec = gl.allocate_shared_memory(gl.float32, [3, BLOCK_H], VEC)
    p_a = _p_chunks(BLOCK_N, BLOCK_H, KEPT_P)
    p_b = _p_chunks(BLOCK_N, BLOCK_H, KEPT_P)
    handed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    taken = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(handed, count=1)            # warpgroup 1's state is in merge_acc
    mbarrier.init(taken, count=1)             # warpgroup 0 has read it
    staged, free = _handover_barriers(STAGES, 4 * 32)     # staged[b]: every loader thread's copies have landed
    gl.warp_specialize([
        (_fp8_persistent_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat0, q_rope0, raw_lat, raw_rope, scale_ring,
                                    p_a, merge_acc, merge_vec, staged, free, handed, taken, SLOTS, num_items,
                                    num_splits, rows_per_split, topk, num_slots, qk_scale_log2, num_heads, stride_qt,
                                    stride_qh, stride_st, stride_ot, stride_oh, stride_lt, BLOCK_H, BLOCK_N, STAGES,
                                    SPLIT, ST_L, 0, DIAG, PIPE, KEPT_P)),
        (_fp8_persistent_consumer, (Q, OUT, LSE, PART_O, PART_LSE, q_lat1, q_rope1, raw_lat, raw_rope, scale_ring,
                                    p_b, merge_acc, merge_vec, staged, free, handed, taken, SLOTS, num_items,
                                    num_splits, rows_per_split, topk, num_slots, qk_scale_log2, num_heads, stride_qt,
                                    stride_qh, stride_st, stride_ot, stride_oh, stride_lt, BLOCK_H, BLOCK_N, STAGES,
                                    SPLIT, ST_L, 1, DIAG, PIPE, KEPT_P)),
        (_fp8_persistent_loader, (KV, SLOTS, raw_lat, raw_rope, scale_stages, staged, free, num_items, num_splits,
                                  rows_per_split, topk, num_slots, kv_row_stride, stride_st, BLOCK_N, STAGES, DIAG)),
    ], [4, 4], [224, 56] if PIPE & (PIPE_S3 | PIPE_O3) else [208, 88])
    # registers a thread: consumers 208 each, loader 88 (the 12 warps' 168 each); three products in flight need 224
    # (208 spill 40 bytes, NOTES.md v19), the loader fits 56


# sm90 builds (scripts/sass_report.py --config '{"gluon": true, ...}'): 16x32 tiles, 4 warps; fp8 242 registers,
# 95 KB of shared memory with 2 stages (two CTAs a SM), 116 KB with 3 (one); bf16 165 registers, 94 KB; no spill.
# H200 (NOTES.md v7): 2 stages 1.15-1.23x the Triton kernel at 128-512 tokens (fp8), 1.07-1.18x (bf16); 3 stages
# (one CTA a SM) and 64-row steps on 8 warps 0.6-1.0x.
DEFAULT_CONFIG = {"impl": "gluon", "rows": False, "ws": False, "p_smem": False, "block_h": 16, "block_n": 32,
                  "num_warps": 4, "stages": 2, "dual_consumers": False, "pipe": "", "kept_p": False}


WGMMA_CONFIG = {"impl": "gluon", "rows": False, "ws": False, "converter": False, "p_smem": False, "block_h": 64,
                "block_n": 64, "num_warps": 8, "stages": 2, "dual_consumers": False, "pipe": "", "kept_p": False}

# 17-128 heads (the default): the same step warp-specialized, a loader warpgroup beside the two consumer warpgroups
# (12 warps, one CTA a SM; sm90 build: loader 56 registers, consumers 224, no spill for bf16/fp16, one 8-byte spill
# slot for fp8_ds_mla). H200, NOTES.md v12 run 1, us at 8 / 128 / 512 tokens against WGMMA_CONFIG: 64 heads bf16
# 27.5 / 103.3 / 406.2 (27.5 / 119.0 / 478.4), fp8_ds_mla 28.3 / 135.6 / 540.4 (29.1 / 161.8 / 622.5); 128 heads bf16
# 35.5 / 193.6 / 837.0 (37.2 / 229.5 / 909.0), fp8_ds_mla 39.4 / 269.7 / 1023.0 (42.0 / 317.2 / 1232.1).
# Since NOTES.md v16 with P.V's A operand through shared memory ("p_smem": the consumers exchange no scores; H200
# v16 call 4, us at 8 / 128 / 512 tokens without -> with: 64 heads bf16 23.5 / 101.2 / 402.8 -> 21.4 / 95.8 / 370.8,
# fp8_ds_mla (loader form) 24.5 / 134.4 / 515.1 -> 22.3 / 125.2 / 482.7, converter form 128.3 / 486.6 -> 125.5 / 475.0;
# 128 heads bf16 192.4 / 771.6 -> 177.5 / 765.2, converter form 244.8 / 941.3 -> 237.5 / 922.3).
WGMMA_WS_CONFIG = {"impl": "gluon", "rows": False, "ws": True, "converter": False, "p_smem": True, "block_h": 64,
                   "block_n": 64, "num_warps": 8, "stages": 2, "dual_consumers": False, "pipe": "", "kept_p": False}
# ... its fp8_ds_mla form with a producer warpgroup that gathers each step into a 2-slot ring of 16-bit tiles and
# dequantizes there, the consumers running the 16-bit step (NOTES.md v15; sm90 build: producer 88 registers, consumers
# 208, no spill, 227,364 bytes of shared memory -- with the p_smem P tile 231,972 of the SM's 232,448); since v28 the
# tiles are fp16 by default (`f16_tile_pays`; that build spills 16 bytes since v30's lazy rescale: one local load a
# producer step, one a consumer step; v29's 24 bytes as many, v28's 32 took 3 + 3 a producer step)
WGMMA_CV_CONFIG = {**WGMMA_WS_CONFIG, "converter": True}
# ... which sparse_mla_attention runs for fp8_ds_mla when a split covers at least this many rows of the top-k (its
# producer's first gathers and conversion are not hidden, so short splits lose). H200, NOTES.md v15 runs 1-2, us
# (loader form -> converter form): 64 heads x 64 / 128 / 512 tokens (16-32 steps a split) 71.7 -> 71.5, 134.7 ->
# 128.4, 520.5 -> 501.5; 128 heads x 32 / 512 tokens 72.9 -> 69.8, 1032.9 -> 925.6; at 4-8 steps a split (64 heads x
# 2-32 tokens) 0.6-1.2 us slower.
CONVERTER_MIN_ROWS = 1024


def converter_pays(fp8: bool, cfg: dict, rows_per_split: int) -> bool:
    """Whether a call of the warp-specialized 64-head tile on an fp8_ds_mla cache takes the converter form:
    splits of >= CONVERTER_MIN_ROWS rows."""
    return fp8 and bool(cfg.get("ws")) and rows_per_split >= CONVERTER_MIN_ROWS


# The converter form's fp16 tile (NOTES.md v28): e4m3 to fp16 times the scale in fp16 (two instructions per two values
# instead of six: the producer's loop 1249 -> 759 instructions a step without the power of two, 790 run with it since
# v29 -- 985 in the build, the rare step's second conversion branched around), q's latent part scaled a head into fp16,
# a power of two a step keeping any cache's values below fp16's overflow (`_step_pow2`, which says where digits are
# lost), one fp16 rounding of the scale and one of each value (call 8, against the float32 reference: lse errors 8-10x
# and output errors 2.4x below FlashMLA's bf16 rounding). H200, v28 call 8 (15 interleaved rounds, x FlashMLA's fp8
# decode, bf16 tile -> fp16 tile): 64 heads x 128 / 512 tokens 0.924 / 0.957 -> 0.956 / 0.994, 128 heads x 32 / 128 /
# 512 1.028 / 0.889 / 0.898 -> 1.038 / 0.947 / 0.958 (without the power of two, a private switch that overflows beyond
# 65,504: 1.007 / 1.037 at 64 heads).
def f16_tile_fits(fp8: bool, cfg: dict) -> bool:
    """Whether a Gluon call can take the fp16 tile: the converter form (fp8_ds_mla), P through shared memory, not a
    timing diagnostic (`check_tile` refuses it elsewhere)."""
    return fp8 and bool(cfg.get("converter")) and bool(cfg.get("p_smem")) and not cfg.get("ws_diag")


def f16_tile_pays(fp8: bool, cfg: dict) -> bool:
    """Whether a Gluon call takes the fp16 tile by default: wherever it fits, since NOTES.md v28."""
    return f16_tile_fits(fp8, cfg)


# P against the kept max (`_kept_max_softmax`, NOTES.md v31): on most steps no reduction across the consumer
# warpgroups (two or three CTA barriers fewer on the path from S to P.V). H200, x FlashMLA's fp8 decode, the converter
# form's fp16 tile without -> with it: v31's calls 1-2 read a gain up to one wave of programs (64 heads x 32 / 64 / 128
# tokens 1.185 / 1.148 / 1.006 -> 1.261 / 1.237 / 1.054) and none or a loss beyond (128 heads x 512 1.011 -> 0.971);
# v32 call 3, the same command in another session (perhaps on the same machine as v32's calls 1-2), a gain at every
# size (64 heads x 256 / 512 1.028 / 1.047 -> 1.103 / 1.120, 128 heads x 512 1.005 -> 1.054), and at sustained load
# (`power_probe`, the GPU busy > 99.9% at its power cap) 2.9-4.7% less time a call at 64-128 heads x 128-512 tokens.
# So the fp16 tile takes it at every size. The loader form and bf16 lost everywhere (v31 call 1: 64 heads x 128
# tokens 0.930 -> 0.839 fp8, 0.916 -> 0.863 bf16).
def kept_fits(fp8: bool, cfg: dict) -> bool:
    """Whether a Gluon call can take P against the kept max (`check_tile` refuses it elsewhere): the warp-specialized
    64-head consumers with P through shared memory, or the dual-consumer fp8_ds_mla kernels; not a timing
    diagnostic (on whatever bytes the ring holds the rare path fires at random)."""
    return not cfg.get("ws_diag") and bool((cfg.get("ws") and cfg.get("p_smem"))
                                           or (cfg.get("rows") and fp8 and cfg.get("dual_consumers")))


def kept_max_pays(fp8: bool, cfg: dict) -> bool:
    """Whether a Gluon call takes P against the kept max by default: the converter form's fp16 tile
    (`f16_tile_fits` with f16_tile); the dual-consumer kernel's 16-head tile and, since NOTES.md v36, its 8-head tile
    one item a program, and both in the paired kernel (v38); nothing else -- not the persistent 8-head kernel (v31)
    -- (an override of the default tile that leaves its kept_p in place gets False where it does not fit)."""
    fp16_tile = f16_tile_fits(fp8, cfg) and cfg.get("f16_tile")
    dual = kernel_of_config(cfg, fp8) in (_sparse_mla_rows_fp8_dual_sm90_kernel,
                                          _sparse_mla_rows_fp8_paired_sm90_kernel)
    return kept_fits(fp8, cfg) and bool(fp16_tile or dual)


# <= 16 heads of a bf16/fp16 cache at small batches: the rows-as-M wgmma kernel (168 KB of shared memory, one 4-warp
# CTA a SM). H200, NOTES.md v8 runs 8-9: 1-8 tokens equal or faster than the mma.sync tile in both runs, by up
# to 2.8 us (16 heads x 1 / 8 tokens 10.1-10.2 / 14.6 us against 11.0-12.4 / 16.7-17.4), 32 tokens 2-8% slower.
# Up to ROWS_MAX_PROGRAMS programs (tokens x head tiles).
ROWS_MAX_PROGRAMS = 16
ROWS_CONFIG = {"impl": "gluon", "rows": True, "ws": False, "p_smem": False, "block_h": 16, "block_n": 64,
               "num_warps": 4, "stages": 2, "resident": 1, "dual_consumers": False, "pipe": "", "kept_p": False}

# <= 16 heads of a bf16/fp16 cache, from there up to one wave (one program a SM): the mma.sync kernel with 64-row
# steps on 4 warps (168 KB of shared memory, one CTA a SM, 48 B of spill in the sm90 build), split only to fill the
# SMs. H200, NOTES.md v9 run 3 (position effect removed): 79.4 / 80.2 us at 8 / 16 heads x 128 tokens, 0.91 of the
# roofline (the 32-row tile: 83.3 / 89.9 us), equal at 32 tokens, 4% slower at 512 (four waves): so one wave only.
ONE_WAVE_CONFIG = {"impl": "gluon", "rows": False, "ws": False, "p_smem": False, "block_h": 16, "block_n": 64,
                   "num_warps": 4, "stages": 2, "resident": 1, "dual_consumers": False, "pipe": "", "kept_p": False}

# <= 16 heads of an fp8_ds_mla cache: the warp-specialized rows-as-M kernel (218 KB of shared memory, one CTA of
# 12 warps a SM). H200, NOTES.md v9 runs 7-8 (its one-producer form) against the 32-row mma.sync tile: 8 heads 11.0 /
# 11.3 / 12.1 / 15.5 / 35.3 / 97.5 / 367 us at 1 / 2 / 4 / 8 / 32 / 128 / 512 tokens (mma.sync 9.0 / 9.6 / 12.0 /
# 15.7 / 37.9 / 112.1 / 392); 16 heads faster at every batch. The three-warpgroup form (v11 run 4): 11.0 / 14.8 /
# 30.4 / 83.3 / 319.4 us at 1 / 8 / 32 / 128 / 512 tokens; 8 heads x 1 / 2 / 3 / 4 / 6 / 8 tokens (v11 run 7) 11.0 /
# 11.4 / 11.7 / 12.0 / 14.5 / 14.9 against mma.sync 9.0 / 9.6 / 11.6 / 12.1 / 15.2 / 15.9. So the default beyond 8
# heads, and from FP8_ROWS_MIN_TOKENS tokens at <= 8 heads.
ROWS_FP8_CONFIG = {"impl": "gluon", "rows": True, "ws": False, "p_smem": False, "block_h": 16, "block_n": 64,
                   "num_warps": 4, "stages": 2, "resident": 1, "dual_consumers": False, "pipe": "", "kept_p": False,
                   "paired": False}
FP8_ROWS_MIN_TOKENS = 4
# ... its dual-consumer form (NOTES.md v17): no converter and no fp16 copy of the rows -- two consumer warpgroups
# convert the staged e4m3 bytes into wgmma's register operand themselves, each on every other step; 4 stages of raw
# rows (~200 KB of shared memory, one CTA of 12 warps a SM). H200, v17 calls 1, 2, 4, us (against ROWS_FP8_CONFIG):
# 8 heads x 16 / 32 / 64 / 128 / 512 tokens 19.1 / 24.9-25.4 / 38.7 / 63.6-65.2 / 241.0-244.2 (19.8 / 27.9-28.1 /
# 46.2 / 78.8-80.3 / 303.5-305.5); 16 heads 22.9 / 28.9-29.1 / 43.9 / 65.7-65.8 / 247.6-250.3 (20.0 / 28.5-28.7 /
# 47.3 / 79.9-80.9 / 306.8-311.3). So the default at 9-16 heads from FP8_DUAL_MIN_TOKENS tokens.
# O^T's products pipelined (pipe "o": consumers at 224 registers, the loader at 56; v19 call 1, interleaved, 16 heads
# x 32 / 128 / 512 tokens 28.3 / 63.1 / 253.5 us against 28.7 / 66.1 / 266.0).
# P^T against the kept max and r (`_kept_max_rows`, NOTES.md v31 call 3, interleaved, x FlashMLA's fp8 decode, 16 heads
# x 32 / 128 / 512 tokens): 1.726 / 1.858 / 1.899 -> 1.741 / 1.864 / 1.960 (0.658 -> 0.678 of the roofline at 512);
# its sm90 build spills 24 bytes (3 LDL + 3 STL a step; none without).
# P^T's tiles re-derived each step (pipe "op", NOTES.md v35 call 3: ptxas had held their wgmma descriptors across the
# loop and spilled them; beside the loader's copies the reloads cost ~400 cycles of a consumer's ~4,900 a step): no
# spill; 21 interleaved rounds, x FlashMLA's fp8 decode, "o" -> "op" at 16 heads x 64 tokens 1.865 -> 1.952.
ROWS_FP8_DUAL_CONFIG = {**ROWS_FP8_CONFIG, "dual_consumers": True, "stages": 4, "pipe": "op", "kept_p": True}
# From FP8_DUAL_MIN_TOKENS tokens at 9-16 heads (v17-v35: 64; NOTES.md v36 call 2, 21 interleaved rounds, us, 16
# heads x 16 / 24 / 32 / 48 tokens, ROWS_FP8_CONFIG -> ROWS_FP8_DUAL_DEEP_CONFIG: 18.67 / 25.10 / 27.12 / 44.21 ->
# 20.81 / 23.79 / 26.72 / 35.74).
FP8_DUAL_MIN_TOKENS = 24
# ... with S^T's products pipelined too (pipe "so", NOTES.md v34 call 1: consumers at 224 registers, 32 bytes of spill,
# three of them local loads on each consumer's common path -- as many as "o" has on one): 21 interleaved rounds, x
# FlashMLA's fp8 decode, "o" -> "so" at 16 heads x 32 / 128 / 512 tokens 1.755 / 1.886 / 1.935 -> 1.715 / 1.905 /
# 1.954 (p20-p80 apart at 128 and 512). So from where the top-k is not split, as at 8 heads (v34-v35).
# With P^T's tiles re-derived each step ("sop", v35 call 3: its 32 bytes of spill gone), "so" -> "sop" at 16 heads x
# 64 / 128 / 512 tokens 1.843 / 1.910 / 1.967 -> 1.946 / 2.055 / 2.144 (p20-p80 apart; "op" 1.952 / 2.035 / 2.111).
# Since v36 "sop" on split calls too, the dual tile's one pipe (us, "op" -> "sop": 16 heads x 24 / 32 / 48 / 64 tokens
# 23.82 / 26.76 / 36.16 / 39.03 -> 23.79 / 26.72 / 35.74 / 38.57 in v36 call 2; v35 call 3 read them equal at 64).
# The shorter consumer step on the 16-head tiles since v40 (NOTES.md v40 calls 1-2, 21 interleaved rounds, us, "sop" ->
# the suffixed form, both with the kept max; the common path of the paired 16-head step 885 -> 845 instructions):
# this tile "soph" 55.5 -> 55.1 at 16 heads x 128 tokens, 39.4 -> 39.1 at 64, 26.6 -> 26.8 at 32 ("f" spills 16 bytes
# here); the paired 16-head tile "sopfh" 103.4 / 204.0 -> 102.3 / 201.6 at 16 heads x 256 / 512 (call 1), 98.0 / 199.2
# -> 96.9 / 197.5 at 168 / 512 (call 2); relative error of the output 0.00167 -> 0.00169 (FlashMLA's fp8 decode
# 0.0039-0.0043). Not on the 8-head tiles: "sopfh" 16.9 / 21.8 / 32.8 -> 17.1 / 22.0 / 33.2 at 8 heads x 16 / 32 / 64
# tokens, the paired one 186.0 -> 185.1 (call 1) and 182.7 -> 183.0 (call 2) at 512.
ROWS_FP8_DUAL_DEEP_CONFIG = {**ROWS_FP8_DUAL_CONFIG, "pipe": "soph"}
# ... its 8-head tile (<= 8 heads: GLM-5 at TP8), which is persistent (NOTES.md v18: one program a SM walks the
# (token, split) items, so the ring does not drain between them; each consumer stages q itself, ~207 KB of shared
# memory). H200, v18 calls 1-3 (interleaved rounds), us at 16 / 32 / 128 / 256 / 512 tokens: 18.6-18.8 / 24.1-24.4 /
# 57.7-58.3 / 109.6 / 212.2-216.4 (ROWS_FP8_DUAL_CONFIG 25.0 / 63.8 / 244.0 at 32 / 128 / 512; ROWS_FP8_CONFIG
# 19.6-19.8 at 16; the same 8-head tile one program an item 18.9 / 24.1-24.3 / 57.5-58.3 / 112.4 / 218.3-220.0).
# So the default at <= 8 heads from 16 tokens in v18-v35 (at 8 tokens 15.0 against 14.8). Both products
# pipelined ("pipe": "so", v18 call 10, interleaved): 18.3 / 54.6 / 207.6 against 18.9 / 57.3 / 218.6 at 16 / 128 /
# 512 tokens.
# (the kept max: "so" 2.014 / 2.041 / 2.178 -> 2.016 / 2.073 / 2.202x at 32 / 128 / 512 tokens, "s3o3" 1.941 / 2.086 /
# 2.285 -> 1.958 / 2.035 / 2.252x, its build spilling 56 bytes: not taken at 8 heads; v31 call 3)
# v18-v35 the default at <= 8 heads from 16 tokens until the top-k is no longer split; NOTES.md v36 calls 1-2 found
# even the 16-head tile with half its heads masked faster there (us, 8 heads x 16 / 24 / 32 / 48 / 64 tokens, this
# tile -> the 16-head one: 18.02 / 21.37 / 23.37 / 32.38 / 34.74 -> 17.38 / 20.45 / 22.30 / 31.84 / 34.09;
# ROWS_FP8_CONFIG 18.41 at 16 tokens, 11.36 against 12.31 at 8), and v36 call 3 the dual kernel's own 8-head tile
# (ROWS_FP8_DUAL_8_CONFIG, below) faster still, and no slower than the persistent "s3o3p" from 67 tokens.
ROWS_FP8_PERSISTENT_CONFIG = {**ROWS_FP8_DUAL_CONFIG, "block_h": 8, "pipe": "so", "kept_p": False, "one_item": False}
FP8_DUAL_MIN_TOKENS_AT_8_HEADS = 16
# ... with three products in flight on both sides (pipe "s3o3", NOTES.md v20: consumers at 224 registers, the loader
# at 56; consumer 1 spills 3 LDL + 3 STL a step). H200, v20 calls 2-3 (interleaved), us at 16 / 32 / 64 / 96 / 128 /
# 256 / 512 tokens: 18.8 / 24.4 / 36.5-36.6 / 50.4 / 54.1-54.2 / 103.5 / 195.2-198.5 against "so" 18.5 / 23.6 /
# 35.3-35.6 / 52.9 / 55.2-55.3 / 105.5 / 200.3-202.8 -- faster once nothing is split (a split is the whole top-k:
# more tokens than half the SMs, `choose_num_splits` at one program a SM), slower on shorter splits, where the loader
# at 56 registers gathers more slowly (its gathers alone at 64 tokens 32.8 against 32.1 us). So the default from
# there in v20-v35. P^T's tiles re-derived each step ("s3o3p", NOTES.md v35 call 3: the same 16 bytes of
# spill, 111 fewer instructions in the build's longest loop), x FlashMLA at 128 / 512 tokens 2.126 / 2.358 -> 2.135 /
# 2.371 (+0.4-0.6%, p20-p80 overlapping).
ROWS_FP8_PERSISTENT_DEEP_CONFIG = {**ROWS_FP8_PERSISTENT_CONFIG, "pipe": "s3o3p"}
# ... and the dual kernel's own 8-head tile, one (token, split) a program ("one_item": not persistent; P stored
# [heads, rows] as in the persistent kernel), "sop" + kept max: the default at <= 8 heads from
# FP8_DUAL_MIN_TOKENS_AT_8_HEADS tokens since v36, up to num_sms since v38 (NOTES.md v36 call 3, 21 interleaved
# rounds, us, 8 heads x 16 / 32 / 64 / 128 / 512 tokens: 16.91 / 22.03 / 33.52 / 52.87 / 204.2 against the 16-head
# tile 17.38 / 22.55 / 34.16 / 55.49 / 220.8 and the persistent "s3o3p" 18.38 / 24.02 / 36.12 / 53.88 / 204.7; "sop"
# without the kept max 17.26 / 22.65 / 34.01 / 53.88 / 210.4). No spill (sm90), 186 KB of shared memory.
ROWS_FP8_DUAL_8_CONFIG = {**ROWS_FP8_DUAL_DEEP_CONFIG, "block_h": 8, "one_item": True, "pipe": "sop"}   # (v40: no "fh")
# ... and both tiles' step on one consumer, two CTAs a SM ("paired", `_sparse_mla_rows_fp8_paired_sm90_kernel`): the
# default at <= 16 heads once the tokens outnumber the SMs (more programs than one wave of the dual kernel). H200,
# NOTES.md v38 calls 1-2 (13 interleaved rounds, us, the dual tile -> the paired one): 8 heads x 136 / 168 / 200 / 232 /
# 256 / 512 tokens 91.8 / 92.6 / 93.5 / 95.8 / 99.2 / 197.8 -> 83.5 / 85.2 / 85.4 / 88.7 / 95.4 / 184.0 (0.84 -> 0.91
# of the roofline at 512); 16 heads 104.7 / 105.1 / 105.3 / 106.0 / 106.6 / 220.3 -> 96.9 / 98.2 / 98.4 / 99.9 / 100.3
# / 206.2 (2.16x -> 2.31x FlashMLA's fp8 decode at 512). At 128 tokens (one wave of the dual kernel; the paired one
# split in two, 256 programs, and merged) slower: 8 heads 51.4 -> 57.1, 16 heads 56.1 -> 66.1.
# The 16-head tile's loader with its row offsets in 32 bits where the cache allows ("offs32": "auto", v41 calls 1, 2
# and 4; a per-layer vLLM cache of < 2 GB does): 16 heads x 128 / 256 / 512 tokens 65.3 / 104.4 / 206.3 -> 64.9 /
# 103.5 / 203.1 us (21 interleaved rounds), and under sustained load (power probe) 227.2 / 226.9 -> 222.8 / 221.6 us
# a call, 153.6 -> 151.5 mJ. Not the 8-head tile's: 8 heads x 168 / 256 / 512 tokens 84.4 / 93.8 / 186.5 -> 86.4 /
# 94.2 / 189.5 us (v41 call 5; v18 / v20 saw no gain from them in the one-CTA loaders either).
ROWS_FP8_PAIRED_CONFIG = {**ROWS_FP8_DUAL_DEEP_CONFIG, "stages": 2, "resident": 2, "paired": True, "pipe": "sopfh",
                          "offs32": "auto"}
ROWS_FP8_PAIRED_8_CONFIG = {**ROWS_FP8_DUAL_8_CONFIG, "stages": 2, "resident": 2, "paired": True, "offs32": False}


# The merge launched early (PDL) and let launch from the attention kernel's start (`_let_merge_launch`), by default
# only for fp8_ds_mla calls of the small-batch kernels (mma.sync, rows-as-M) whose grid holds at most half the SMs.
# H200, NOTES.md v25 call 1 (each call timed twice in one process, CUDA-graph time), us, default -> early merge: fp8
# 8 heads x 1 token (64 programs) 7.55 -> 7.04, 16 heads x 1 / 2 tokens (32 / 64 programs) 9.19 / 9.72 -> 8.57 /
# 9.03; at 128 programs (8 heads x 2-8 tokens, 16 heads x 4-8) it cost 0.3-0.95 us, and bf16 calls gained <= 0.3
# us at 8 tokens but lost up to 0.85 at 1-4 (the early launch without the kernel's signal: +0.1-0.2 everywhere).
PDL_MAX_SM_FRACTION = 0.5


def pdl_pays(cfg: dict, fp8: bool, programs: int, num_sms: int) -> bool:
    """Whether a Gluon call launches its merge early by default (PDL_MAX_SM_FRACTION): an fp8_ds_mla call of a kernel
    that signals it (`_let_merge_launch`: the mma.sync and the one-consumer rows-as-M kernels) whose grid leaves at
    least half the SMs idle, so the merge's programs wait there."""
    kernel = kernel_of_config(cfg, fp8)
    return fp8 and "PDL" in kernel.arg_names and programs <= num_sms * PDL_MAX_SM_FRACTION


def default_config(num_heads: int, fp8: bool = False, num_tokens: int | None = None, num_sms: int = 132) -> dict:
    """The Gluon tile of a call: the warp-specialized 64-head wgmma tile beyond 16 heads; up to 16 heads one head
    tile a token, and the tile follows the batch -- bf16/fp16: rows-as-M wgmma up to ROWS_MAX_PROGRAMS tokens, the
    64-row mma.sync tile up to one wave (num_sms tokens), the 32-row mma.sync tile (two CTAs a SM) beyond;
    fp8_ds_mla: the warp-specialized rows-as-M kernel, its dual-consumer form ("sop": both products pipelined, P^T's
    tiles re-derived each step; the 16-head tiles with NOTES.md v40's shorter step, "h" / "fh"; P^T against the kept
    max) at 9-16 heads from FP8_DUAL_MIN_TOKENS tokens on
    16-head tiles and at <= 8 heads from FP8_DUAL_MIN_TOKENS_AT_8_HEADS on 8-head tiles, and from there its paired
    form (one consumer, two CTAs a SM) beyond num_sms tokens; the 32-row mma.sync tile at 1-3 tokens of <= 8 heads
    (more, shorter splits)."""
    if num_heads > 16:
        return dict(WGMMA_WS_CONFIG)
    if num_tokens is None:
        return dict(DEFAULT_CONFIG)
    if fp8:
        if num_tokens >= (FP8_DUAL_MIN_TOKENS if num_heads > 8 else FP8_DUAL_MIN_TOKENS_AT_8_HEADS):
            if num_tokens > num_sms:
                return dict(ROWS_FP8_PAIRED_CONFIG if num_heads > 8 else ROWS_FP8_PAIRED_8_CONFIG)
            return dict(ROWS_FP8_DUAL_DEEP_CONFIG if num_heads > 8 else ROWS_FP8_DUAL_8_CONFIG)
        if num_heads > 8 or num_tokens >= FP8_ROWS_MIN_TOKENS:
            return dict(ROWS_FP8_CONFIG)
        return dict(DEFAULT_CONFIG)
    if num_tokens <= ROWS_MAX_PROGRAMS:
        return dict(ROWS_CONFIG)
    if num_tokens <= num_sms:
        return dict(ONE_WAVE_CONFIG)
    return dict(DEFAULT_CONFIG)


def one_item_a_program(cfg: dict) -> bool:
    """Whether a tile config's dual 8-head tile runs one (token, split) a program: unless it names one_item False (the
    persistent kernel, no default since NOTES.md v36; before v37 a config that did not name it ran persistent below
    FP8_DUAL_MIN_TOKENS_AT_8_HEADS tokens, where the default tile has no such key)."""
    return bool(cfg.get("one_item", True))


def resolve_paired(cfg: dict, named: dict) -> dict:
    """A call's tile (`named`, the caller's _config, laid over the default) with its paired form settled by what the
    caller named: over a paired default (beyond num_sms tokens since NOTES.md v38), a tile that is not the
    dual-consumer kernel's, names other stages than the paired form's 2 or names one_item False (the persistent
    kernel) is not paired; a tile that names paired takes that form's stages (paired 2, the dual kernel 4) and program
    slots a SM (2, 1) unless it names them."""
    out = dict(cfg)
    if "paired" in named:
        paired = bool(named["paired"])
    else:
        paired = bool(out.get("paired") and out.get("dual_consumers") and out.get("stages") == 2
                      and one_item_a_program(out))
    if paired != bool(out.get("paired")) or "paired" in named:
        out["paired"] = paired
        if out.get("dual_consumers") and "stages" not in named:
            out["stages"] = 2 if paired else 4
        if "resident" not in named:
            out["resident"] = 2 if paired else 1
    return out


def kernel_of_config(cfg: dict, fp8: bool):
    """`kernel_of` for a tile config (the keys launch reads)."""
    return kernel_of(cfg["block_h"], fp8, cfg.get("rows", False), cfg.get("ws", False), cfg.get("converter", False),
                     cfg.get("dual_consumers", False), one_item_a_program(cfg), cfg.get("paired", False))


def kernel_of(block_h: int, fp8: bool, rows: bool = False, ws: bool = False, converter: bool = False,
              dual: bool = False, one_item: bool = False, paired: bool = False):
    """The Gluon kernel of a head tile and layout (rows: a rows-as-M wgmma kernel; for fp8_ds_mla the
    warp-specialized one, with dual its dual-consumer form -- with 8-head tiles the persistent kernel unless one_item,
    one (token, split) a program; with dual and paired its one-consumer form, two CTAs a SM, before any of those;
    ws: the warp-specialized 64-head kernel; with converter, its fp8_ds_mla form that dequantizes in a producer
    warpgroup). Every flag explicit, as the offline builds name them; a tile config's kernel is
    `kernel_of_config`'s, where a dual 8-head tile is one item a program unless it says otherwise."""
    if rows and fp8 and dual and paired:
        return _sparse_mla_rows_fp8_paired_sm90_kernel
    if rows and fp8 and dual and block_h == 8 and not one_item:
        return _sparse_mla_rows_fp8_persistent_sm90_kernel
    if rows and fp8 and dual:
        return _sparse_mla_rows_fp8_dual_sm90_kernel
    if ws and converter and fp8:
        return _sparse_mla_wgmma_cv_sm90_kernel
    if ws:
        return _sparse_mla_wgmma_ws_sm90_kernel
    if rows:
        return _sparse_mla_rows_fp8_sm90_kernel if fp8 else _sparse_mla_rows_sm90_kernel
    if block_h == 64:
        return _sparse_mla_wgmma_sm90_kernel
    return _sparse_mla_fp8_sm90_kernel if fp8 else _sparse_mla_16bit_sm90_kernel


# the dual-consumer kernel's pipelined sides ("pipe"): none, O^T's products, both, both three at a time (v20); the
# 16-head tile both two at a time at most (NOTES.md v34: "so" spills 32 bytes with the kept max, three in flight
# 136-192); a "p" after any of them but "": P^T's tiles re-derived each step (PIPE_P, v35: no spill left in the
# 16-head "so" build)
PIPES_OF_TILE = {8: ("", "o", "so", "s3o3", "op", "sop", "s3o3p"), 16: ("", "o", "so", "op", "sop")}
# ... each of them with an "f" (PIPE_F) and / or an "h" (PIPE_H) after it: a shorter consumer step (NOTES.md v40)
STEP_SUFFIXES = ("", "f", "h", "fh")


def pipe_base(pipe: str) -> tuple[str, str]:
    """A pipe split into its products' part and its step suffix (`STEP_SUFFIXES`), e.g. "sopfh" -> ("sop", "fh")."""
    suffix = max((x for x in STEP_SUFFIXES if pipe.endswith(x)), key=len)     # ("" ends every pipe)
    return pipe[:len(pipe) - len(suffix)], suffix


def pipe_bits(pipe: str) -> int:
    """The kernels' PIPE constexpr of a tile's "pipe" (its letters: s for PIPE_S, o for PIPE_O; a 3 after one: that
    side three products at a time, PIPE_S3 / PIPE_O3; p: P^T's tiles re-derived each step, PIPE_P; f: q's rope part
    staged times its multiplier, PIPE_F; h: P^T scaled in fp16 pairs, PIPE_H)."""
    return ((PIPE_S.value if "s" in pipe else 0) | (PIPE_O.value if "o" in pipe else 0)
            | (PIPE_S3.value if "s3" in pipe else 0) | (PIPE_O3.value if "o3" in pipe else 0)
            | (PIPE_P.value if "p" in pipe else 0) | (PIPE_F.value if "f" in pipe else 0)
            | (PIPE_H.value if "h" in pipe else 0))


# Timing diagnostics of the warp-specialized kernels (_config {"ws_diag": N, "_diagnostic": True}; results wrong on
# purpose; NOTES.md v10, v11, v13): 1 loader and converter alone (gathers and conversion, no products), 2 the
# consumer alone (products on whatever the ring holds, no gathers), 3 the gathers alone (no conversion, no products),
# 4 converter and consumer without gathers (whatever the staging buffer holds, converted and multiplied), 5 the
# 64-head fp8_ds_mla kernel without its dequantization (the products read the bf16 tile as it stands). 1-4 apply to
# the fp8_ds_mla rows-as-M kernel, 2-3 to the warp-specialized 64-head kernel (either layout), 5 to its fp8 form,
# 1-4 to its converter form (v15; the converter's in-place conversion of the raw rows the gathers left), 6 to the
# converter form only (v16: 4 without the producer's shared-memory reads of the raw rows).
# (Their builds drop what they leave unused: the 64-head gathers alone take 84 KB of shared memory, so beyond one
# program a SM two share it -- time that one at <= num_sms programs, e.g. 128 tokens.)
WS_DIAGNOSTICS = {0: "full kernel", 1: "producer only", 2: "consumer only", 3: "gathers only",
                  4: "converter and consumer, no gathers", 5: "no dequantization",
                  6: "converter (bytes held in registers) and consumers, no gathers"}


def check_tile(cfg: dict, fp8: bool, num_heads: int | None = None) -> None:
    """Refuse, with the reason, a tile the kernels do not build: the rows-as-M kernels take 16-head tiles, 64-row
    steps and one (consumer) warpgroup, the fp8 one 2 stages (a _config laid over a default can mix two tiles' keys);
    the dual-consumer kernel also 8-head tiles (one item a program, or persistent), for calls of <= 8 heads
    (num_heads, when given: more would read every row once per tile), and 4 stages -- its paired form (one consumer,
    two CTAs a SM, one item a program) 2."""
    dual = cfg.get("dual_consumers", False)
    if cfg.get("rows") and (cfg["block_h"] not in ((8, 16) if dual else (16,))
                            or (cfg["block_n"], cfg["num_warps"]) != (64, 4)):
        raise Glm5labError("the rows-as-M wgmma kernels (the dual-consumer one: 8-head tiles too) take 16-head tiles, "
                           f"64-row steps and 4 warps, got block_h {cfg['block_h']}, block_n {cfg['block_n']}, "
                           f"num_warps {cfg['num_warps']}")
    if dual and cfg["block_h"] == 8 and num_heads is not None and num_heads > 8:
        raise Glm5labError(f"the dual-consumer kernel's 8-head tile takes calls of <= 8 heads, got {num_heads} (more "
                           "would gather every row once per head tile: use the 16-head tile)")
    if cfg.get("ws") and (cfg["block_h"], cfg["block_n"], cfg["num_warps"], cfg["stages"]) != (64, 64, 8, 2):
        raise Glm5labError("the warp-specialized 64-head kernel takes 64-head tiles, 64-row steps, 8 warps and 2 "
                           f"stages, got block_h {cfg['block_h']}, block_n {cfg['block_n']}, num_warps "
                           f"{cfg['num_warps']}, stages {cfg['stages']}")
    if cfg.get("f16_tile") and not f16_tile_fits(fp8, cfg):
        raise Glm5labError("f16_tile=True is the 64-head converter form's option (fp8_ds_mla, its producer "
                           "dequantizing into fp16 tiles; P through shared memory; no timing diagnostic); got it with "
                           f"{'an fp8_ds_mla' if fp8 else 'a bf16/fp16'} cache, "
                           f"converter={cfg.get('converter', False)}, p_smem={cfg.get('p_smem', False)} and "
                           f"ws_diag={cfg.get('ws_diag', 0)}")
    if cfg.get("p_smem") and not cfg.get("ws"):
        raise Glm5labError("p_smem=True is the warp-specialized 64-head kernel's consumer option (P through shared "
                           f"memory); got it with ws={cfg.get('ws', False)}")
    if dual and not (cfg.get("rows") and fp8):
        raise Glm5labError("dual_consumers=True is a form of the fp8_ds_mla rows-as-M kernel (<= 16 heads); got it "
                           f"with rows={cfg.get('rows', False)} and {'an fp8_ds_mla' if fp8 else 'a bf16/fp16'} cache")
    pipe = cfg.get("pipe", "")
    base, suffix = pipe_base(pipe) if dual else (pipe, "")
    if base not in (PIPES_OF_TILE[cfg["block_h"]] if dual else ("",)):     # (dual: an 8- or 16-head tile, above)
        raise Glm5labError(f"pipe={pipe!r}: the dual-consumer fp8_ds_mla kernel's products issued async, two at a time "
                           "(NOTES.md v18-v19), on S^T's side 's' and/or O^T's 'o', a 3 after one: three (v20), "
                           "a 'p' after all: P^T's tiles re-derived each step (v35), then 'f' and / or 'h': q's rope "
                           "part staged times its multiplier, P^T scaled in fp16 pairs (v40) -- "
                           "the 8-head tile any of "
                           f"{PIPES_OF_TILE[8]}, the 16-head tile {PIPES_OF_TILE[16]} (three in flight spill there); "
                           "got "
                           f"it with dual_consumers={dual}, block_h {cfg['block_h']}")
    paired = cfg.get("paired", False)
    if paired and not one_item_a_program(cfg):
        raise Glm5labError("paired=True runs one (token, split) a program; one_item=False is the persistent kernel's")
    if paired and not dual:
        raise Glm5labError("paired=True is a form of the dual-consumer fp8_ds_mla kernel (its step on one consumer, "
                           f"two CTAs a SM); got it with dual_consumers={dual}")
    if dual and (cfg["stages"] != (2 if paired else 4) or cfg.get("ws_diag", 0) not in (0, 2, 3)):
        raise Glm5labError("the dual-consumer fp8_ds_mla kernel takes 4 stages (~200 KB of shared memory; its paired "
                           "form 2, ~110 KB, two CTAs a SM) and timing diagnostics 2-3 only; got stages "
                           f"{cfg['stages']}{' (paired)' if paired else ''}, ws_diag {cfg.get('ws_diag', 0)}")
    if cfg.get("rows") and fp8 and not dual and cfg["stages"] != 2:
        raise Glm5labError("the fp8_ds_mla rows-as-M kernel takes 2 stages (218 KB of shared memory), got "
                           f"{cfg['stages']}")
    converter = cfg.get("converter", False)
    if converter and not (fp8 and cfg.get("ws")):
        raise Glm5labError("converter=True is the warp-specialized 64-head kernel's fp8_ds_mla form (a producer "
                           f"warpgroup dequantizes); got it with {'an fp8_ds_mla' if fp8 else 'a bf16/fp16'} cache and "
                           f"ws={cfg.get('ws', False)}")
    diag = cfg.get("ws_diag", 0)
    fits = ((fp8 and cfg.get("rows") and diag in ((2, 3) if dual else (1, 2, 3, 4)))
            or (converter and diag in (1, 2, 3, 4, 6))
            or (cfg.get("ws") and not converter and (diag in (2, 3) or (fp8 and diag == 5))))
    if diag not in WS_DIAGNOSTICS or (diag and (cfg.get("_diagnostic") is not True or not fits)):
        raise Glm5labError(f"ws_diag {diag!r} is a private timing diagnostic (wrong results) with _diagnostic=True: "
                           "1-4 of the fp8_ds_mla rows-as-M kernel (2-3 of its dual-consumer form), 2-3 of the "
                           "warp-specialized 64-head kernel, 5 of "
                           f"its fp8_ds_mla form, 1-4 and 6 of its converter form ({WS_DIAGNOSTICS})")
    if cfg.get("kept_p") and not kept_fits(fp8, cfg):
        raise Glm5labError("kept_p=True is an option of the warp-specialized 64-head consumers with P through shared "
                           "memory and of the dual-consumer fp8_ds_mla kernels, not of a timing diagnostic (NOTES.md "
                           f"v31); got it with ws={cfg.get('ws', False)}, p_smem={cfg.get('p_smem', False)}, "
                           f"rows={cfg.get('rows', False)}, dual_consumers={cfg.get('dual_consumers', False)} and "
                           f"ws_diag={cfg.get('ws_diag', 0)}")


def build_options(kernel) -> dict:
    """Compile options a Gluon kernel is built with beyond its tile's (`launch`, and scripts/sass_report.py's offline
    builds): the paired kernel's register cap, so that two CTAs of 8 warps share a SM."""
    return {"maxnreg": PAIRED_MAXNREG} if kernel is _sparse_mla_rows_fp8_paired_sm90_kernel else {}


def loader_offs32(cfg: dict, kernel, kv) -> bool:
    """Whether a launch builds the paired kernel's loader with 32-bit row offsets (tile key "offs32", NOTES.md
    v40-v41): True asks for them (refused on another kernel or a cache of 2^31 elements or more), "auto" (the paired
    16-head default's) takes them where the kernel and the cache allow, False / absent never."""
    offs32 = cfg.get("offs32", False)
    if offs32 == "auto":
        return "OFFS32" in kernel.arg_names and kv.numel() < 2**31
    if offs32:
        if "OFFS32" not in kernel.arg_names:
            raise Glm5labError(f"offs32=True: only the paired fp8_ds_mla kernel takes it, not {kernel.fn.__name__}")
        if kv.numel() >= 2**31:
            raise Glm5labError(f"offs32=True needs a cache of < 2^31 elements (32-bit row offsets); this one has "
                               f"{kv.numel()}")
    return bool(offs32)


def launch(grid, args, cfg: dict, split: bool, fp8: bool, part_f16: bool = False, num_heads: int | None = None,
           num_sms: int = 132, pdl: bool = False) -> None:
    """One launch of a Gluon kernel; args as the Triton kernel's, without its fused-merge counter. part_f16: the
    split's partials in fp16 (the 64-head kernels only); num_heads: the call's, for `check_tile`; num_sms: the GPU's
    (a persistent kernel's programs); pdl: the merge is launched early (programmatic dependent launch), and the
    kernels that can (`_let_merge_launch`) let it launch from their start."""
    check_tile(cfg, fp8, num_heads)
    kernel = kernel_of_config(cfg, fp8)
    extra = {"FP8": fp8} if "FP8" in kernel.arg_names else {}     # (the wgmma kernel serves both layouts)
    if "num_items" in kernel.arg_names:       # persistent: one program a SM walks the (token, split) items
        _, num_tokens, num_splits = grid         # (one head tile: <= 8 heads)
        extra["num_items"] = num_tokens * num_splits
        grid = (max(1, min(extra["num_items"], num_sms)),)
    if cfg.get("ws_diag"):
        extra["DIAG"] = cfg["ws_diag"]
    if cfg.get("p_smem"):
        extra["P_SMEM"] = True
    if cfg.get("f16_tile"):
        extra["F16_TILE"] = True
    if cfg.get("pipe"):
        extra["PIPE"] = pipe_bits(cfg["pipe"])
    if "_raw_swizzle" in cfg and "RAW_SWIZZLE" in kernel.arg_names:       # (a private A/B switch, NOTES.md v15)
        extra["RAW_SWIZZLE"] = bool(cfg["_raw_swizzle"])
    if "_f16_pow2" in cfg and cfg.get("f16_tile"):   # (a private A/B switch, NOTES.md v28: False overflows fp16)
        extra["POW2"] = bool(cfg["_f16_pow2"])
    if cfg.get("kept_p"):
        extra["KEPT_P"] = True
    if cfg.get("offs32") and loader_offs32(cfg, kernel, args[1]):
        extra["OFFS32"] = True
    if (pdl or cfg.get("_trigger_dependents")) and "PDL" in kernel.arg_names:
        extra["PDL"] = True        # (_trigger_dependents: a private switch, the tail split's first grid, NOTES.md v44)
    if cfg.get("_dependent_launch"):           # (private: launched as the previous grid's dependent, NOTES.md v44)
        extra["launch_pdl"] = True
    if (cfg.get("_stamps") or (None,))[0] is not None:    # (attention, merge) int64 buffers: stamps, a diagnostic
        if "STAMPS" not in kernel.arg_names:
            raise Glm5labError(f"phase stamps: {kernel.fn.__name__} writes none (the 1-3 token fp8_ds_mla mma.sync "
                               "kernel writes PHASES, the dual and paired fp8_ds_mla kernels WAVE_STAMPS)")
        check_stamps(cfg["_stamps"][0], grid[0] * grid[1] * grid[2], kernel.fn.__name__)
        extra["STAMPS"] = cfg["_stamps"][0]
    if part_f16:
        if "PART_F16" not in kernel.arg_names:
            raise Glm5labError(f"fp16 partials: only the 64-head Gluon kernels write them, not {kernel.fn.__name__} "
                               "(or pass _config={'impl': 'triton'})")
        extra["PART_F16"] = True
    extra.update(build_options(kernel))
    kernel[grid](*args, BLOCK_H=cfg["block_h"], BLOCK_N=cfg["block_n"], STAGES=cfg["stages"], SPLIT=split,
                 num_warps=cfg["num_warps"], **extra)
