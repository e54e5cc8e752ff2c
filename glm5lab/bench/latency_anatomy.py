"""Where one decode token's sparse-MLA call spends its time on the GPU (issue 7's 1-token target).

CUDA-graph replay time (GPU only, as a captured decode step sees it) of: an empty Triton kernel (the floor a
graph launch costs), glm5lab's kernel for ONE token at top-k 64 / 256 / 2048 with no split, and at top-k 2048
with 8 / 16 / 32 splits and the default, in both layouts, with the cache cold (524,288 slots, 32 rotating
input sets: rows and their TLB entries out of L2) and L2-resident (4,096 slots, one input set replayed).
The differences place the time: launch floor, first gather chain, per-step cost, split and merge cost.
--sweep instead times 1-8 tokens (8 and 64 heads, cold cache, top-k 2048) over split counts, both merges and
a narrower step (v6: the split/merge policy for small batches comes from it); --sweep --splits N ... only the
default merge at those split counts. --kernels gives each kernel's own GPU time (attention grid, merge) from the
torch profiler (v13: the merge, not the grid, was what four splits cost at 64 heads x 32 tokens).

    PYTHONPATH=. python -m glm5lab.bench.latency_anatomy --out results/kernels/latency_anatomy_h200.csv
    PYTHONPATH=. python -m glm5lab.bench.latency_anatomy --sweep --out results/kernels/small_batch_sweep_h200.csv
    PYTHONPATH=. python -m glm5lab.bench.latency_anatomy --kernels --sweep-heads 64 --tokens 8 32 --splits 0 1 4 \
        --out results/kernels/small_batch_sweep_h200.csv
"""
from __future__ import annotations

import argparse
import json
import sys

import triton

from glm5lab.bench.records import command_line
from glm5lab.bench.kernel_bench import input_sets
from glm5lab.bench.timing import need_gpu
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors

SUITE = "sparse_mla_latency"


@triton.jit
def _empty_kernel(X):
    pass


def cases():
    """(top-k, num_splits or None for the default) measured per layout and cache."""
    return [(64, 1), (256, 1), (2048, 1), (2048, 8), (2048, 16), (2048, 32), (2048, None)]


def sweep_cases(layout: str, policy: bool = False, splits=None, configs=None):
    """(num_splits or None, merge, _config or None) of the small-batch sweep for one layout. The first sweep
    (v6, run 1) chose the split/merge policy; `policy=True` times the chosen default beside the same with the
    early (PDL) merge launch and beside the fused merge at the same split count; `splits` (counts, 0 = the
    default) times the default merge at each of those split counts only; `configs` (a list of _config dicts)
    times the default beside the default with each of them."""
    if configs:
        return [(None, "auto", None)] + [(None, "auto", dict(c)) for c in configs]
    if splits:
        return [(s or None, "auto", None) for s in splits]
    if policy:
        return [(None, "auto", None), (None, "auto", {"pdl": True}), (None, "fused", None)]
    narrow = {"block_n": 16} if layout == "fp8_ds_mla" else {"block_n": 32}
    out = [(splits, merge, None) for splits in (None, 8, 16, 32, 64) for merge in ("fused", "separate")]
    return out + [(splits, "separate", narrow) for splits in (64, 128)]


def _caches(slots_n: int, gen):
    """A random bf16 cache of slots_n slots (blocks of 64) and its fp8_ds_mla copy, by layout name."""
    import torch

    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla

    kv = torch.randn(slots_n // 64, 64, 576, device="cuda", generator=gen).to(torch.bfloat16)
    return {"bf16": kv, "fp8_ds_mla": quantize_fp8_ds_mla(kv)}


def gpu_kernel_spans(prof) -> list:
    """(start_us, end_us, name) of every GPU kernel a torch profiler recorded."""
    import torch

    return [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA]


def _graph_us(cache, tokens: int, heads: int, topk: int, slots_n: int, n_sets: int, gen, **kw) -> float:
    """CUDA-graph time of one sparse_mla_attention call over n_sets fresh (bf16 q, random slots) input sets, at least
    32 calls a graph (fewer sets repeat: with one call a graph, the graph's own launch showed in the time -- v27:
    the L2-warm case 8.7 us against 7.1 cold)."""
    from glm5lab.bench.kernel_bench import graph_time_us
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    scale = mla_softmax_scale()
    calls = [lambda q=q, s=s: sparse_mla_attention(q, cache, s, scale, **kw)
             for q, s in input_sets(tokens, heads, topk, slots_n, n_sets, gen)]
    return graph_time_us(calls * max(1, -(-32 // len(calls))))


def _row(shape: str, layout: str, us: float, implementation: str = "glm5lab", dtype: str = "bf16",
         unit: str = "us") -> dict:
    return {"suite": SUITE, "implementation": implementation, "shape": shape, "dtype": dtype, "layout": layout,
            "metric": "time_graph", "value": us, "unit": unit}


def sweep(csv_path, command: str = "", verbose: bool = True, tokens=(1, 2, 4, 8), heads=(8, 64), policy=False,
          splits=None, configs=None, layouts=("bf16", "fp8_ds_mla")):
    """Small-batch split/merge sweep (cold cache, 32 rotating input sets, CUDA-graph time) over `layouts`."""
    import torch
    from tqdm.auto import tqdm

    from glm5lab.bench.records import append_rows

    need_gpu("the small-batch sweep")
    gen = torch.Generator(device="cuda").manual_seed(11)
    slots_n, topk = 524_288, 2048
    caches = _caches(slots_n, gen)
    jobs = [(lay, h, t, c) for lay in caches if lay in layouts for h in heads for t in tokens
            for c in sweep_cases(lay, policy, splits, configs)]
    rows = []
    for lay, h, t, (n_splits, merge, cfg) in tqdm(jobs, desc="small-batch sweep", disable=not verbose):
        us = _graph_us(caches[lay], t, h, topk, slots_n, 32, gen, num_splits=n_splits, merge=merge, _config=cfg)
        narrow = "".join(f"_{k}{v}" for k, v in (cfg or {}).items()).replace("block_n", "N")
        shape = f"T{t}_H{h}_K{topk}_S{n_splits if n_splits else 'auto'}_{merge}{narrow}"
        rows.append(_row(shape, lay, us))
        if verbose:
            tqdm.write(f"  {lay:10s} {shape:36s} {us:7.2f} us")
    append_rows(csv_path, rows, command=command or "latency_anatomy --sweep")
    return rows


def kernel_split(csv_path, command: str = "", verbose: bool = True, tokens=(8, 32), heads=(64,), splits=(0, 1, 4)):
    """GPU time of each kernel of a split call (attention grid, merge), from the torch profiler over 32 rotating
    input sets run eagerly (cold cache, top-k 2048): where a split's cost goes, which graph time cannot say."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile
    from tqdm.auto import tqdm

    from glm5lab.bench.records import append_rows
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    need_gpu("the per-kernel split anatomy")
    gen = torch.Generator(device="cuda").manual_seed(13)
    slots_n, topk, n_sets = 524_288, 2048, 32
    caches = _caches(slots_n, gen)
    jobs = [(lay, h, t, s) for lay in caches for h in heads for t in tokens for s in splits]
    rows = []
    for lay, h, t, s in tqdm(jobs, desc="kernel split anatomy", disable=not verbose):
        call = [lambda q=q, sl=sl: sparse_mla_attention(q, caches[lay], sl, mla_softmax_scale(), num_splits=s or None)
                for q, sl in input_sets(t, h, topk, slots_n, n_sets, gen)]
        for c in call:
            c()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for c in call:
                c()
            torch.cuda.synchronize()
        per_kernel = collections.defaultdict(float)
        for start, end, name in gpu_kernel_spans(prof):
            per_kernel[name] += (end - start) / n_sets
        shape = f"T{t}_H{h}_K{topk}_S{s if s else 'auto'}"
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            rows.append({**_row(shape, lay, us, implementation=name[:60]), "metric": "kernel_time"})
            if verbose:
                tqdm.write(f"  {lay:10s} {shape:24s} {name[:50]:50s} {us:7.2f} us")
    append_rows(csv_path, rows, command=command or "latency_anatomy --kernels")
    return rows


def timeline_parts(events) -> dict:
    """Medians over the calls in `events` ((start_us, end_us, kernel name) of one stream's kernels, any order): a call
    is an attention kernel followed by a merge kernel (its name holds "merge"). {} when there is no such pair."""
    import statistics

    ev = sorted(events)
    calls = [(a, m) for a, m in zip(ev, ev[1:]) if "merge" not in a[2] and "merge" in m[2]]
    if not calls:
        return {}
    parts = {"attention_us": [a[1] - a[0] for a, _ in calls], "merge_us": [m[1] - m[0] for _, m in calls],
             "merge_start_after_attention_start_us": [m[0] - a[0] for a, m in calls],
             "merge_end_after_attention_end_us": [m[1] - a[1] for a, m in calls],
             "call_us": [m[1] - a[0] for a, m in calls]}
    return {k: statistics.median(v) for k, v in parts.items()}


def merge_timeline(csv_path, command: str = "", verbose: bool = True, tokens=(1, 2, 4, 8), heads=(8, 16),
                   configs=None):
    """When the merge runs against the attention grid: each call's two kernels as the profiler (CUPTI) sees them
    inside a replayed CUDA graph of 32 rotating input sets (cold cache), per `_config` in `configs` (default: the
    merge in stream order and launched early). Medians over the calls: the attention's duration, the merge's, the
    merge's start after the attention's start and its end after the attention's end (an early-launched merge's
    programs start waiting while the attention runs), and the call from the attention's start to the merge's end.
    What graph time alone cannot say: whether the early merge lengthens the attention or shortens the tail."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from tqdm.auto import tqdm

    from glm5lab.bench.kernel_bench import graph_timer
    from glm5lab.bench.records import append_rows
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    need_gpu("the merge timeline")
    configs = configs or [{"impl": "gluon", "pdl": False}, {"impl": "gluon", "pdl": True}]
    gen = torch.Generator(device="cuda").manual_seed(17)
    slots_n, topk, n_sets = 524_288, 2048, 32
    caches = _caches(slots_n, gen)
    jobs = [(lay, h, t, c) for lay in caches for h in heads for t in tokens for c in configs]
    rows = []
    for lay, h, t, cfg in tqdm(jobs, desc="merge timeline", disable=not verbose):
        replay = graph_timer([lambda q=q, sl=sl: sparse_mla_attention(q, caches[lay], sl, mla_softmax_scale(),
                                                                      _config=dict(cfg))
                              for q, sl in input_sets(t, h, topk, slots_n, n_sets, gen)], 1)
        replay()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        parts = timeline_parts(gpu_kernel_spans(prof))
        if not parts:
            continue                                    # an unsplit call has no merge to place
        shape = f"T{t}_H{h}_K{topk}" + "".join(f"_{k}{v}" for k, v in cfg.items())
        for metric, value in parts.items():
            rows.append({**_row(shape, lay, value), "metric": metric})
        if verbose:
            tqdm.write(f"  {lay:10s} {shape:40s} " + " ".join(f"{k[:-3]} {v:.2f}" for k, v in parts.items()))
    append_rows(csv_path, rows, command=command or "latency_anatomy --timeline")
    return rows


def phase_parts(att, merge) -> dict:
    """One call's phase stamps (the kernels' `PHASES`): att [programs, STAMP_SLOTS] and merge [programs, STAMP_SLOTS]
    int64 as the kernels wrote them, rows left at -1 by programs that did not run (a buffer larger than the grid)
    dropped. Within a program the SM's clock (clock64) places its phases from that program's own start (phase<k>_us),
    converted to ns by the median of every program's globaltimer span over its clock span; globaltimer places the
    programs' starts and ends and the merge's stamps from the grid's first program start. Returns medians over
    programs and the last program's start / end and the merge's last end (us), the program counts, ns_per_clock and
    the timer's smallest step (globaltimer_step_ns)."""
    import statistics

    att = [r for r in att if r[0] >= 0]
    merge = [r for r in merge if r[0] >= 0]
    if not att:
        return {}
    ns_per_clock = statistics.median([(r[13] - r[0]) / (r[12] - r[1]) for r in att if r[12] > r[1]] or [0.0])
    t0 = min(r[0] for r in att)
    med = statistics.median
    out = {"ns_per_clock": ns_per_clock, "programs": len(att),
           "program_start_us": med([r[0] - t0 for r in att]) / 1e3,
           "last_program_start_us": max(r[0] - t0 for r in att) / 1e3}
    for k in (*range(2, 13), 14, 15):              # (14-15: a finer look inside the first step, when written)
        if all(r[k] >= 0 for r in att):
            out[f"phase{k}_us"] = med([(r[k] - r[1]) * ns_per_clock for r in att]) / 1e3
    out["attention_end_us"] = med([r[13] - t0 for r in att]) / 1e3
    out["last_attention_end_us"] = max(r[13] - t0 for r in att) / 1e3
    if merge:
        out["merge_programs"] = len(merge)
        out["merge_start_us"] = med([r[0] - t0 for r in merge]) / 1e3
        out["merge_released_us"] = med([r[1] - t0 for r in merge]) / 1e3
        out["merge_end_us"] = med([r[2] - t0 for r in merge]) / 1e3
        out["last_merge_end_us"] = max(r[2] - t0 for r in merge) / 1e3
    stamps = sorted({r[k] for r in att for k in (0, 13)} | {r[k] for r in merge for k in (0, 1, 2)})
    steps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
    out["globaltimer_step_ns"] = float(min(steps)) if steps else 0.0
    return out


def phases(csv_path, command: str = "", verbose: bool = True, tokens=(1, 2), heads=(8,), configs=None,
           cache: str = "cold"):
    """Inside the 1-3 token fp8_ds_mla kernel (mma.sync, 8 heads) and its merge: each program's phase stamps
    (`sparse_mla_sm90.PHASES`, a diagnostic build of the same kernel) in a replayed CUDA graph (cache "cold": 32
    rotating input sets over 524,288 slots; "l2": one input set over 4,096 slots, so the rows, slot indices and q
    come from L2), per `_config` in `configs` (default: the merge in stream order and launched early); medians over
    the calls of `phase_parts`. Where the attention program's time goes between its gathers' issue and its partial's
    store, and when the merge starts, may read and ends against the last attention program's end."""
    import statistics

    import torch
    from tqdm.auto import tqdm

    from glm5lab.bench.kernel_bench import graph_timer
    from glm5lab.bench.records import append_rows
    from glm5lab.kernels.sparse_mla import STAMP_SLOTS, sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    need_gpu("the phase stamps")
    configs = configs or [{"impl": "gluon", "pdl": False}, {"impl": "gluon", "pdl": True}]
    gen = torch.Generator(device="cuda").manual_seed(23)
    if cache not in ("cold", "l2"):
        raise Glm5labError(f"cache must be 'cold' or 'l2', got {cache!r}")
    (slots_n, n_sets), topk, most = ((524_288, 32) if cache == "cold" else (4_096, 1)), 2048, 4096
    kv = _caches(slots_n, gen)["fp8_ds_mla"]
    rows = []
    for h, t, cfg in tqdm([(h, t, c) for h in heads for t in tokens for c in configs], desc="phase stamps",
                          disable=not verbose):
        sets = input_sets(t, h, topk, slots_n, n_sets, gen)
        bufs = [tuple(torch.full((most, STAMP_SLOTS.value), -1, dtype=torch.int64, device="cuda") for _ in "am")
                for _ in sets]
        replay = graph_timer([lambda q=q, sl=sl, b=b: sparse_mla_attention(
            q, kv, sl, mla_softmax_scale(), _config={**cfg, "_stamps": b}) for (q, sl), b in zip(sets, bufs)], 1)
        replay()
        torch.cuda.synchronize()
        calls = [phase_parts(a.tolist(), m.tolist()) for a, m in bufs]
        parts = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
        shape = f"T{t}_H{h}_K{topk}" + "".join(f"_{k}{v}" for k, v in cfg.items()) + ("_l2" if cache == "l2" else "")
        rows += [{**_row(shape, "fp8_ds_mla", v, unit=k.rsplit("_", 1)[-1] if k.endswith(("_us", "_ns")) else "-"),
                  "metric": k} for k, v in parts.items()]
        if verbose:
            tqdm.write(f"  {shape:40s} " + " ".join(f"{k.removesuffix('_us')} {v:.3g}" for k, v in parts.items()))
    append_rows(csv_path, rows, command=command or "latency_anatomy --phases")
    return rows


def run(csv_path, heads: int = 8, command: str = "", verbose: bool = True):
    import torch

    from glm5lab.bench.kernel_bench import graph_time_us
    from glm5lab.bench.records import append_rows

    need_gpu("the latency anatomy")
    log = (lambda *a: print(*a, flush=True)) if verbose else (lambda *a: None)
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = []

    x = torch.zeros(1, device="cuda")
    empty_us = graph_time_us([lambda: _empty_kernel[(1,)](x)] * 32)
    rows.append(_row("grid1", "-", empty_us, implementation="empty-triton-kernel", dtype="-"))
    log(f"empty Triton kernel in a graph: {empty_us:.2f} us")

    for cache_name, slots_n, n_sets in (("cold", 524_288, 32), ("l2", 4_096, 1)):
        caches = _caches(slots_n, gen)
        for layout, cache in caches.items():
            for topk, splits in cases():
                us = _graph_us(cache, 1, heads, topk, slots_n, n_sets, gen, num_splits=splits)
                shape = f"T1_H{heads}_K{topk}_S{splits if splits else 'auto'}_{cache_name}"
                rows.append(_row(shape, layout, us))
                log(f"  {layout:10s} {shape:28s} {us:7.2f} us")
        del caches
    append_rows(csv_path, rows, command=command or "latency_anatomy")
    return rows


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm5lab.bench.latency_anatomy", description=first_paragraph(__doc__))
    p.add_argument("--out", required=True, help="CSV to append long-format rows to")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="the small-batch split/merge sweep instead")
    p.add_argument("--policy", action="store_true", help="with --sweep: the default policy, without PDL, fused")
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8], help="with --sweep")
    p.add_argument("--sweep-heads", type=int, nargs="*", default=[8, 64], help="with --sweep")
    p.add_argument("--kernels", action="store_true",
                   help="per-kernel GPU time (attention grid, merge) of --sweep-heads x --tokens x --splits instead")
    p.add_argument("--splits", type=int, nargs="*", default=None,
                   help="with --sweep: these split counts only (0 = the default policy's), the default merge")
    p.add_argument("--timeline", action="store_true",
                   help="when the merge runs against the attention grid (profiler, in a CUDA graph) for "
                        "--sweep-heads x --tokens x --configs (default: the merge in stream order, then early)")
    p.add_argument("--layouts", nargs="+", default=["bf16", "fp8_ds_mla"], choices=["bf16", "fp8_ds_mla"],
                   help="with --sweep: the cache layouts to time")
    p.add_argument("--phases", action="store_true",
                   help="the 1-3 token fp8_ds_mla kernel's phase stamps and its merge's, on one time axis, for "
                        "--sweep-heads x --tokens x --configs (default: the merge in stream order, then early)")
    p.add_argument("--cache", choices=["cold", "l2"], default="cold",
                   help="with --phases: 524,288 slots and 32 rotating input sets, or 4,096 slots and one (L2-warm)")
    p.add_argument("--configs", nargs="+", default=None, metavar="JSON",
                   help='with --sweep: the default beside the default with each _config, e.g. \'{"impl": "gluon"}\'')
    args = p.parse_args(argv)
    configs = None
    if args.configs:
        try:
            configs = [json.loads(c) for c in args.configs]
        except json.JSONDecodeError as exc:
            raise Glm5labError(f"--configs takes JSON objects: {exc}") from None
        if not all(isinstance(c, dict) for c in configs):
            raise Glm5labError(f"--configs takes JSON objects, got {args.configs}")
    command = command_line("glm5lab.bench.latency_anatomy", argv)
    if args.phases:
        phases(args.out, command=command, tokens=tuple(args.tokens), heads=tuple(args.sweep_heads),
               configs=configs, cache=args.cache)
    elif args.timeline:
        merge_timeline(args.out, command=command, tokens=tuple(args.tokens), heads=tuple(args.sweep_heads),
                       configs=configs)
    elif args.kernels:
        kernel_split(args.out, command=command, tokens=tuple(args.tokens), heads=tuple(args.sweep_heads),
                     splits=tuple(args.splits or (0, 1, 4)))
    elif args.sweep:
        sweep(args.out, command=command, tokens=tuple(args.tokens), heads=tuple(args.sweep_heads),
              policy=args.policy, splits=args.splits, configs=configs, layouts=tuple(args.layouts))
    else:
        run(args.out, args.heads, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
