"""Can the Hopper TMA engine gather a token's random fp8_ds_mla rows as fast as cp.async, and for less power?

The paired kernels' loader is 128 threads issuing 22 cp.async a step each, ~447 instructions a thread a step, about a
third of what a paired SM issues (NOTES.md v40); under sustained load both paired kernels run at the 700 W cap. A
loader built from TMA copies would issue the same bytes from ONE thread: a few boxes a row, each completing on the
stage's mbarrier by bytes, with rows at slot -1 or past the cache zero-filled by TMA's bounds. Before anyone rebuilds
the kernel around that, this measures the gather alone: the paired kernel's ring (2 stages of 64 rows, two CTAs a
SM, one program a token), filled by TMA and freed at once by a consumer that does nothing else -- the TMA twin of
the kernel's own gathers-alone diagnostic (`pair16sopd3`), which `run` times beside it in the same process on the
same inputs (interleaved CUDA-graph rounds, and sustained blocks with NVML's clock, power and energy a call).

Box plans (`PLANS`), the cache viewed as int32 [slots, 164]:
- "rows3": three boxes a row: the 512 latent bytes ([1, 128] words), the rope ([1, 32] at word 132), the scales
  ([1, 4] at word 128). TMA writes shared memory only at 128-byte aligned addresses (a 528-byte row pitch, which
  would spare the consumers' loads their bank conflicts without a swizzle, faults: misaligned address, NOTES.md
  v41), so the latent rows land 512 bytes apart, unswizzled;
- "rows6": the latent part in four 128-byte boxes instead;
- "rows6s": those four boxes into [64, 128]-byte chunk tiles in wgmma's 128-byte swizzle -- the layout the dual
  consumers read without conflicts (Gluon 3.6 refuses a one-row box into a swizzled tile, NOTES.md v22: the copies
  name an unswizzled view of the tile and the descriptor carries the swizzle, which TMA applies by address);
- "rows3s": three boxes a row with the latent part in the 128-byte swizzle: a 3-D box [1, 4, 128 bytes] (the cache
  viewed as [slots, 4 chunks, 32 words]) lands a row's four chunks in four consecutive 128-byte lines, and TMA XORs
  each line's 16-byte units with its address bits 7-9: chunk j of row r with j + 4 * (r & 1). TMA issues such a
  box at the rate of one 512-byte box (rows3), not of four 128-byte ones (rows6), so a swizzled three-box loader
  can exist; `consumer_bank_conflicts` counts what its layout would cost the consumers' loads (NOTES.md v42);
- "x4": the same boxes issued from four loader warps instead of one (a warp issues its rows' copies one at a time).

    python -m glm5lab.bench.tma_gather_probe --out results/kernels/tma_gather_probe_h200.csv --tokens 128 512
    python -m glm5lab.bench.tma_gather_probe --bank-conflicts    # what the consumers' loads would pay (no GPU)
"""
from __future__ import annotations

import argparse
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.kernels.sparse_mla_sm90 import _handover_barriers

SUITE = "tma_gather_probe"
ROW_WORDS = gl.constexpr(164)    # an fp8_ds_mla row: 512 e4m3 bytes, 4 float32 scales, 64 bf16 rope values
SCALE_WORD = gl.constexpr(128)
ROPE_WORD = gl.constexpr(132)
BLOCK_N = gl.constexpr(64)       # rows a step (the paired kernels')
STAGES = gl.constexpr(2)
PLANS = {"rows3": (3, False, 1), "rows6": (6, False, 1), "rows3x4": (3, False, 4), "rows6x4": (6, False, 4),
         "rows6s": (6, True, 1), "rows6sx4": (6, True, 4), "rows3s": (3, True, 1), "rows3sx4": (3, True, 4)}
# (boxes a row, latent in wgmma's 128-byte swizzle, loader warps)
DEFAULT_PLANS = ("rows3", "rows6", "rows6x4", "rows6sx4")     # what `run` and the command line time unless told
BOX_WORDS = (128, 32, 32, 4)     # the descriptors' boxes: latent part, one 128-byte chunk of it, rope, scales
LAUNCH = {"num_warps": 4, "maxnreg": 128}   # a consumer warpgroup and the loader's warps; two CTAs a SM, as paired
SWIZZLE_128B = 3                 # CUtensorMapSwizzle
UNSWIZZLED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
UNSWIZZLED3 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))
LINE_BOX = [1, 4, 32]            # rows3s: a row's latent part as four 128-byte lines
# the swizzled plans' chunk tiles [64 rows, 128 bytes], 1024-byte aligned, in wgmma's 128-byte swizzle: TMA writes a
# row's chunk through an unswizzled one-row view of the tile (Gluon 3.6 refuses a one-row box into a swizzled tile)
# with a descriptor whose swizzle `tma_gather` sets to 128B -- the hardware swizzles by the destination's address
CHUNK_TILE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
SLOT_L = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))
ONE_L = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
STORE_L = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _step_slots(slot_row, i, topk):
    """Step i's 64 slot indices (-1 past the top-k), two a lane of a loader's warp."""
    n = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=SLOT_L)
    return gl.load(slot_row + n, mask=n < topk, other=-1)


@gluon.jit
def _tma_row_loader(lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring, slot_bufs,
                    full, free, t, topk, num_steps, stride_st, BOXES: gl.constexpr, SWIZZLED: gl.constexpr,
                    LOADERS: gl.constexpr, W: gl.constexpr):
    """Loader warp W of LOADERS: rows r = W mod LOADERS of step i by TMA into stage i % STAGES once it is free, every
    box on `full[b]` by bytes. A step's slot indices are loaded a step ahead (one vector load) and parked in shared
    memory, from which each box reads its row's index as a scalar: no copy waits on a global load."""
    slot_row = SLOTS + t * stride_st
    slot_buf = slot_bufs.slice(W * BLOCK_N, BLOCK_N)
    slot_buf.store(_step_slots(slot_row, 0, topk))
    gl.thread_barrier()
    for i in range(num_steps):
        b = i % STAGES
        nxt = _step_slots(slot_row, i + 1, topk)
        mbarrier.wait(free.index(b), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(b), BLOCK_N // LOADERS * (512 + 128 + 16))
        for r in gl.static_range(BLOCK_N):
            if r % LOADERS == W:
                slot = gl.max(slot_buf.slice(r, 1).load(ONE_L), axis=0)   # -1 / past the cache: zero-filled
                if BOXES == 3:
                    if SWIZZLED:    # the row's four lines, 512 bytes from the stage's start times r
                        dst = lat_ring.index(b)._reinterpret(gl.int32, [BLOCK_N, 4, 32], UNSWIZZLED3).slice(r, 1)
                        tma.async_copy_global_to_shared(lat_desc, [slot, 0, 0], full.index(b), dst)
                    else:
                        tma.async_copy_global_to_shared(lat_desc, [slot, 0], full.index(b),
                                                        lat_ring.index(b).slice(r, 1))
                else:
                    for c in gl.static_range(4):
                        if SWIZZLED:
                            dst = lat_ring.index(4 * b + c)._reinterpret(gl.int32, [BLOCK_N, 32], UNSWIZZLED)
                            dst = dst.slice(r, 1)
                        else:
                            dst = lat_ring.index(b).slice(r, 1).slice(32 * c, 32, dim=1)
                        tma.async_copy_global_to_shared(chunk_desc, [slot, 32 * c], full.index(b), dst)
                tma.async_copy_global_to_shared(rope_desc, [slot, ROPE_WORD], full.index(b),
                                                rope_ring.index(b).slice(r, 1))
                tma.async_copy_global_to_shared(scale_desc, [slot, SCALE_WORD], full.index(b),
                                                scale_ring.index(b).slice(r, 1).slice(0, 4, dim=1))
        gl.thread_barrier()
        slot_buf.store(nxt)
        gl.thread_barrier()


@gluon.jit
def _drain_rows(OUT, lat_ring, rope_ring, scale_ring, full, free, t, topk, num_steps, SWIZZLED: gl.constexpr,
                CHECK: gl.constexpr, BOXES: gl.constexpr):
    """The consumer: waits for each stage and frees it; with CHECK it first stores the stage's rows to OUT [tokens,
    topk, 164] int32 (what a test compares with the cache's rows), the swizzled latent read through its swizzled
    layout (rows3s: the stage's 512-byte rows as 128-byte lines in wgmma's 128-byte swizzle, which TMA's
    address-keyed swizzle matches on a 1024-byte aligned stage)."""
    for i in range(num_steps):
        b = i % STAGES
        mbarrier.wait(full.index(b), (i // STAGES) & 1)
        if CHECK:
            rows = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, STORE_L))
            base = OUT + (t * topk + rows[:, None]).to(gl.int64) * ROW_WORDS
            ok = rows[:, None] < topk
            w = gl.arange(0, 32, layout=gl.SliceLayout(0, STORE_L))
            if SWIZZLED and BOXES == 3:    # the stage as 256 lines of 128 bytes, line 4 r + j = row r's chunk j
                lines = i * BLOCK_N * 4 + gl.arange(0, BLOCK_N * 4, layout=gl.SliceLayout(1, STORE_L))
                at = OUT + (t * topk + lines[:, None] // 4).to(gl.int64) * ROW_WORDS + 32 * (lines[:, None] % 4)
                lat = lat_ring.index(b)._reinterpret(gl.int32, [BLOCK_N * 4, 32], CHUNK_TILE).load(STORE_L)
                gl.store(at + w[None, :], lat, mask=lines[:, None] // 4 < topk)
            elif SWIZZLED:
                for c in gl.static_range(4):
                    gl.store(base + 32 * c + w[None, :], lat_ring.index(4 * b + c).load(STORE_L), mask=ok)
            else:
                w4 = gl.arange(0, 128, layout=gl.SliceLayout(0, STORE_L))
                gl.store(base + w4[None, :], lat_ring.index(b).load(STORE_L), mask=ok)
            gl.store(base + ROPE_WORD + w[None, :], rope_ring.index(b).load(STORE_L), mask=ok)
            sc = scale_ring.index(b).load(STORE_L)
            gl.store(base + SCALE_WORD + w[None, :], sc, mask=ok & (w[None, :] < 4))
            gl.thread_barrier()
        mbarrier.arrive(free.index(b))


@gluon.jit
def _tma_gather_kernel(lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, OUT, topk, stride_st,
                       BOXES: gl.constexpr, SWIZZLED: gl.constexpr, LOADERS: gl.constexpr, CHECK: gl.constexpr):
    """Program t: token t's top-k rows through a 2-stage ring of 64-row steps filled by TMA from LOADERS warps."""
    t = gl.program_id(0)
    num_steps = gl.cdiv(topk, BLOCK_N)
    if SWIZZLED and BOXES == 3:     # 512-byte rows, 1024-byte aligned stages: the swizzle by address bits 7-9
        lat_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N * 4, 32], CHUNK_TILE)
    elif SWIZZLED:
        lat_ring = gl.allocate_shared_memory(gl.int32, [STAGES * 4, BLOCK_N, 32], CHUNK_TILE)
    else:
        lat_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 128], UNSWIZZLED)
    rope_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], UNSWIZZLED)
    scale_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], UNSWIZZLED)
    slot_bufs = gl.allocate_shared_memory(gl.int32, [LOADERS * BLOCK_N], FLAT)
    full, free = _handover_barriers(STAGES, LOADERS)     # full[b]: each loader warp's expected bytes arrived
    # (the partitions' arguments written out in each call: a tuple held in a variable turns its constexprs into
    # runtime values)
    if LOADERS == 1:
        gl.warp_specialize([
            (_drain_rows, (OUT, lat_ring, rope_ring, scale_ring, full, free, t, topk, num_steps, SWIZZLED, CHECK,
                            BOXES)),
            (_tma_row_loader, (lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring,
                               slot_bufs, full, free, t, topk, num_steps, stride_st, BOXES, SWIZZLED, LOADERS, 0)),
        ], [1], [96])
    else:
        gl.static_assert(LOADERS == 4, "1 or 4 loader warps")
        gl.warp_specialize([
            (_drain_rows, (OUT, lat_ring, rope_ring, scale_ring, full, free, t, topk, num_steps, SWIZZLED, CHECK,
                            BOXES)),
            (_tma_row_loader, (lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring,
                               slot_bufs, full, free, t, topk, num_steps, stride_st, BOXES, SWIZZLED, LOADERS, 0)),
            (_tma_row_loader, (lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring,
                               slot_bufs, full, free, t, topk, num_steps, stride_st, BOXES, SWIZZLED, LOADERS, 1)),
            (_tma_row_loader, (lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring,
                               slot_bufs, full, free, t, topk, num_steps, stride_st, BOXES, SWIZZLED, LOADERS, 2)),
            (_tma_row_loader, (lat_desc, chunk_desc, rope_desc, scale_desc, SLOTS, lat_ring, rope_ring, scale_ring,
                               slot_bufs, full, free, t, topk, num_steps, stride_st, BOXES, SWIZZLED, LOADERS, 3)),
        ], [1, 1, 1, 1], [96, 96, 96, 96])


def _lines_plan(plan: str) -> bool:
    """Whether the plan copies a row's latent part as one box of four 128-byte lines (rows3s)."""
    boxes, swizzled, _ = PLANS[plan]
    return boxes == 3 and swizzled


def descriptors(cache_words, plan: str = "rows3"):
    """The four TMA descriptors over the cache as int32 [slots, 164]: the whole latent part (rows3s: as [slots, 4,
    32], one box its four lines), one 128-byte chunk of it, the rope part, the scales."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if cache_words.dtype.itemsize != 4 or cache_words.dim() != 2 or cache_words.shape[1] != ROW_WORDS.value:
        raise Glm5labError(f"the cache must be viewed as int32 [slots, {ROW_WORDS.value}] (fp8_ds_mla rows); got "
                           f"{cache_words.dtype} {tuple(cache_words.shape)}")
    descs = [TensorDescriptor.from_tensor(cache_words, [1, w], UNSWIZZLED.value) for w in BOX_WORDS]
    if _lines_plan(plan):
        descs[0] = TensorDescriptor(cache_words, [cache_words.shape[0], 4, 32], [ROW_WORDS.value, 32, 1], LINE_BOX,
                                    UNSWIZZLED3.value)
    return descs


def plan_constexprs(plan: str, check: bool = False) -> dict:
    """The kernel's constexprs for a box plan (`PLANS`)."""
    if plan not in PLANS:
        raise Glm5labError(f"unknown TMA box plan {plan!r}; expected one of {sorted(PLANS)}")
    boxes, swizzled, loaders = PLANS[plan]
    return {"BOXES": boxes, "SWIZZLED": swizzled, "LOADERS": loaders, "CHECK": check}


def offline_source(plan: str = "rows3", check: bool = False):
    """The probe kernel as a Gluon source for `triton.compile` without a GPU (scripts/sass_report.py
    {"tma_probe": true}), with the options `tma_gather` launches it with: (source, options)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = [f"tensordesc<i32[1, {w}],{UNSWIZZLED.value!r}>" for w in BOX_WORDS]
    if _lines_plan(plan):
        desc[0] = f"tensordesc<i32{LINE_BOX},{UNSWIZZLED3.value!r}>"
    sig = {"lat_desc": desc[0], "chunk_desc": desc[1], "rope_desc": desc[2], "scale_desc": desc[3],
           "SLOTS": "*i32", "OUT": "*i32", "topk": "i32", "stride_st": "i32"}
    names = list(_tma_gather_kernel.arg_names)
    consts = {(names.index(k),): v for k, v in plan_constexprs(plan, check).items()}
    sig.update({k: "constexpr" for k in plan_constexprs(plan, check)})
    return GluonASTSource(fn=_tma_gather_kernel, signature=sig, constexprs=consts), dict(LAUNCH)


def tma_gather(cache_words, slots, plan: str = "rows3", out=None, check: bool = False):
    """Token t's top-k rows (slots [tokens, topk] int32) gathered by TMA; with check, returned as [tokens, topk, 164]
    int32 (zeros where a slot is -1 or past the cache), else only waited for (the probe's timed form)."""
    import torch

    consts = plan_constexprs(plan, check)
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.stride(1) != 1:
        raise Glm5labError(f"slots must be int32 [tokens, topk] with contiguous rows; got {slots.dtype} "
                           f"{tuple(slots.shape)}")
    num_tokens, topk = slots.shape
    if out is None:
        out = torch.zeros(num_tokens if check else 1, topk if check else 1, ROW_WORDS.value, dtype=torch.int32,
                          device=slots.device)
    args = (*descriptors(cache_words, plan), slots, out, topk, slots.stride(0))
    if consts["SWIZZLED"]:
        _swizzle_latent_descriptor(_tma_gather_kernel.warmup(*args, grid=(num_tokens,), **consts, **LAUNCH),
                                   _lines_plan(plan))
    _tma_gather_kernel[(num_tokens,)](*args, **consts, **LAUNCH)
    return out


def _swizzle_latent_descriptor(compiled, lines: bool) -> None:
    """Make the launcher encode the latent copies' descriptor (rows3s: the first, four lines a box; rows6s: the
    second, one chunk a box) with the 128-byte swizzle: the kernel was built with an unswizzled one-row view as the
    copies' destination (what Gluon accepts), the tile its consumer reads is swizzled, and TMA applies the swizzle
    by the shared-memory address it writes."""
    which, block = (0, LINE_BOX) if lines else (1, [1, 32])
    meta = compiled.metadata.tensordesc_meta
    if not meta or len(meta) != len(BOX_WORDS) or meta[which]["block_size"] != block:
        raise Glm5labError(f"unexpected TMA descriptor metadata {meta!r}: Triton's launcher changed")
    meta[which]["swizzle"] = SWIZZLE_128B


def _parity(x: int) -> int:
    return bin(x).count("1") & 1


def _chunk_layout(offset_of) -> "gl.SharedLinearLayout":
    """A [64 rows, 128 bytes] int8 chunk tile whose (row, col) -> byte offset is offset_of (XOR-linear, bijective)."""
    rows, cols = BLOCK_N.value, 128
    coords = {offset_of(r, c): [r, c] for r in range(rows) for c in range(cols)}
    if len(coords) != rows * cols:
        raise Glm5labError("the chunk's offset map is not a bijection")
    return gl.SharedLinearLayout(offset_bases=[coords[1 << i] for i in range((rows * cols).bit_length() - 1)])


def tma_row_layout(parity_mask: int = 1) -> "gl.SharedLinearLayout":
    """A latent chunk as rows3s lands it, for bank counts: TMA's 128-byte swizzle XORs a line's 16-byte units with its
    address bits 7-9, and of those only bit 9 -- the parity of a 512-byte row's place -- differs between rows of one
    chunk. parity_mask picks which top-k rows go to odd places (row r's parity = parity(r & mask); the loader would
    put row r at r with bit 0 replaced by it, a bijection when the mask has bit 0). Rows at a 128-byte pitch here:
    the banks are address bits 2-6, so only the swizzle bit matters."""
    if parity_mask % 2 != 1 or not 0 < parity_mask < BLOCK_N.value:
        raise Glm5labError(f"parity_mask must be odd and under {BLOCK_N.value}; got {parity_mask}")
    return _chunk_layout(lambda r, c: (r << 7) | (c ^ (_parity(r & parity_mask) << 6)))


def consumer_bank_conflicts(layouts=None) -> dict:
    """Bank conflicts a wavefront (Triton's own count, as `gl.bank_conflicts` gives inside a kernel) of the dual and
    paired consumers' e4m3 loads -- K (`DUAL_K8`) and V^T (`DUAL_V8`) from a [64, 128]-byte latent chunk -- per shared
    layout: {name: {"K": n, "V^T": n}}. Default: the kernels' own ring layout, rows3s as TMA lands it, and rows3s
    with its best row placement (every odd mask tried)."""
    from triton._C.libtriton import gluon_ir, ir

    from glm5lab.kernels.sparse_mla_sm90 import DUAL_K8, DUAL_V8, ROWS_SM8

    if layouts is None:
        layouts = {"ring (ROWS_SM8)": ROWS_SM8.value, "rows3s": tma_row_layout(1)}
        layouts.update({f"rows3s, parity mask {m:#x}": tma_row_layout(m) for m in range(3, BLOCK_N.value, 2)})
    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)

    def count(distr, shared):
        return builder.get_shared_bank_conflicts(distr._to_ir(builder), shared._to_ir(builder), [BLOCK_N.value, 128], 8)

    return {name: {"K": count(DUAL_K8.value, lay), "V^T": count(DUAL_V8.value, lay)} for name, lay in layouts.items()}


def gathers_alone(heads: int, num_tokens: int) -> dict:
    """The default tile's timing diagnostic at this size: its loader's gathers alone (ws_diag 3, wrong results),
    with neither the kept max nor v40's step suffixes, which belong to the consumers' step that it leaves out."""
    from glm5lab.kernels.sparse_mla_sm90 import check_tile, default_config

    cfg = {**default_config(heads, True, num_tokens), "_diagnostic": True, "ws_diag": 3, "kept_p": False}
    cfg["pipe"] = cfg["pipe"].rstrip("fh")
    check_tile(cfg, True, heads)
    return cfg


def run(out_csv: str, tokens=(128, 512), heads: int = 16, plans=DEFAULT_PLANS, rounds: int = 21,
        sustained_rounds: int = 3, topk: int = 2048, num_slots: int = 524288, command: str = "") -> list:
    """Per token count: every TMA plan beside the paired kernel's gathers alone (cp.async, `pair16sopd3` or its
    8-head twin), the default tile's gathers alone at that token count ("default-d3": the dual kernel's at one wave)
    and the default itself, interleaved CUDA-graph rounds, then sustained blocks (NVML)."""
    import torch

    from glm5lab.bench import power_probe
    from glm5lab.bench.kernel_bench import GLUON_VARIANTS, capture_graph, input_sets, replay_timer, rotating_sets
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import interleaved_samples, need_gpu, quantiles
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    need_gpu("the TMA gather probe")
    known = dict(GLUON_VARIANTS)
    d3 = f"pair{heads}sopd3"
    gen = torch.Generator(device="cuda").manual_seed(1234)
    cache = power_probe.random_fp8_cache(num_slots, gen)
    words = cache.view(torch.int32).reshape(num_slots, ROW_WORDS.value)
    scale = mla_softmax_scale()
    nvml = power_probe.current_device_nvml()
    rows_out = []
    try:
        for T in tokens:
            sets = input_sets(T, heads, topk, num_slots, rotating_sets(T, topk), gen)
            for q, s in sets[:1]:                       # the probe's rows are the cache's rows
                for plan in plans:
                    got = tma_gather(words, s, plan, check=True)
                    want = words[s.clamp(0, num_slots - 1).long()] * (s >= 0)[..., None]
                    if not torch.equal(got, want):
                        raise Glm5labError(f"TMA plan {plan} gathered wrong rows at {T} tokens")
            graphs = {f"tma-{p}": capture_graph([lambda s=s, p=p: tma_gather(words, s, p) for _, s in sets])
                      for p in plans}
            for form, cfg in ((d3, known[d3]), ("default-d3", gathers_alone(heads, T)), ("glm5lab", None)):
                cfg = None if cfg is None else {**cfg, "impl": "gluon"}
                graphs[form] = capture_graph([lambda q=q, s=s, cfg=cfg: sparse_mla_attention(q, cache, s, scale,
                                                                                             _config=cfg)
                                              for q, s in sets])
            shape = f"H{heads}_T{T}_K{topk}"
            times = interleaved_samples({f: replay_timer(g, len(sets)) for f, g in graphs.items()}, rounds)
            rows = []
            for form, us in times.items():
                q = quantiles(us)
                rows.append({"suite": SUITE, "implementation": form, "shape": shape, "dtype": "bf16",
                             "layout": "fp8_ds_mla", "metric": "time", "value": q["p50"], "unit": "us", **q})
            samples = power_probe.sustained_samples(graphs, len(sets), sustained_rounds, 1.0, nvml)
            rows += [{**row, "suite": SUITE} for row in power_probe.rows_of(samples, shape)]
            append_rows(out_csv, rows, command=command)
            rows_out += rows
            for form in graphs:
                p50 = {row["metric"]: row["value"] for row in rows if row["implementation"] == form}
                print(f"T{T} {form:>14}: rounds {p50['time']:.1f} us | sustained {p50['time_us']:.1f} us "
                      f"{p50['sm_clock_mhz']:.0f} MHz {p50['power_w']:.0f} W {p50['energy_uj_per_call'] / 1e3:.1f} mJ",
                      flush=True)
    finally:
        nvml.close()
    return rows_out


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.tma_gather_probe", description=first_paragraph(__doc__))
    ap.add_argument("--out", help="CSV the rows are appended to (the GPU measurement)")
    ap.add_argument("--bank-conflicts", action="store_true",
                    help="print the consumers' bank conflicts on the ring and on rows as TMA lands them (no GPU)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--heads", type=int, default=16, choices=(8, 16))
    ap.add_argument("--plans", nargs="+", default=list(DEFAULT_PLANS), choices=list(PLANS))
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--sustained-rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.bank_conflicts:
        for name, count in consumer_bank_conflicts().items():
            print(f"{name:>28}: K {count['K']}, V^T {count['V^T']} (excess accesses a wavefront)")
        return 0
    if not args.out:
        ap.error("--out is required for the GPU measurement")
    run(args.out, tuple(args.tokens), args.heads, tuple(args.plans), args.rounds, args.sustained_rounds,
        command=command_line("glm5lab.bench.tma_gather_probe", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
