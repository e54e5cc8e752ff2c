"""Before/after of a top-k kernel change, in one process on the same logits: glm5lab's top-k kernels (this tree)
against those of another copy of glm5lab/kernels/dsa_indexer.py (`--before`: e.g. the previous commit's, carried
to the device in the git-ignored .ab/), each timed in CUDA graphs as the indexer bench times them (>= 8 calls a
graph: what vLLM's captured decode step sees), with both outputs checked identical first. Rows (metric
topk_time_graph, implementation glm5lab-triton-<method> and ...-<method>-before) are appended to --out. --timeline
also places each copy's kernels inside one replayed graph with the torch profiler (CUPTI): rows kernel_time_in_graph
(each kernel's mean duration a call, implementation ...:<kernel>) and graph_gap_time (the idle time between one
call's kernels) -- where a multi-launch top-k's fixed cost goes, which the graph time alone cannot say.

    git show HEAD~1:glm5lab/kernels/dsa_indexer.py > .ab/dsa_indexer_before.py
    PYTHONPATH=. python scripts/topk_ab.py --before .ab/dsa_indexer_before.py --out results/indexer/topk_ab.csv
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from glm5lab.bench.kernel_bench import graph_time_us, graph_timer
from glm5lab.bench.latency_anatomy import gpu_kernel_spans
from glm5lab.bench.records import append_rows
from glm5lab.bench.timing import need_gpu
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.kernels import dsa_indexer


def load_before(path: Path):
    """The other copy of the module, imported under its own name (it imports glm5lab's helpers as usual)."""
    if not path.is_file():
        raise Glm5labError(f"--before {path}: no such file (git show <rev>:glm5lab/kernels/dsa_indexer.py > {path})")
    spec = importlib.util.spec_from_file_location("dsa_indexer_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "indexer_topk"):
        raise Glm5labError(f"--before {path}: has no indexer_topk, not a copy of glm5lab/kernels/dsa_indexer.py")
    return module


def kernel_timeline(calls) -> tuple[dict, float]:
    """Each kernel's mean GPU time a call ({name: us}) and the mean idle time between a call's kernels (us), from
    the profiler's record of one replay of `calls` captured in a CUDA graph."""
    from torch.profiler import ProfilerActivity, profile

    replay = graph_timer(calls, 1)
    replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    events = sorted(gpu_kernel_spans(prof))
    per_kernel = {}
    for start, end, name in events:
        per_kernel[name] = per_kernel.get(name, 0.0) + (end - start) / len(calls)
    busy = sum(per_kernel.values())
    span = (events[-1][1] - events[0][0]) / len(calls) if events else 0.0
    return per_kernel, span - busy


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=first_paragraph(__doc__))
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--methods", nargs="+", default=["split"], choices=dsa_indexer.TOPK_METHODS)
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384, 65536])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128, 256])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--timeline", action="store_true", help="also each kernel's time inside a replayed graph")
    args = ap.parse_args(argv)
    before = load_before(args.before)
    need_gpu("the top-k A/B")
    command = "python scripts/topk_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    cases = [(L, B) for L in args.contexts for B in args.batches]
    for L, B in tqdm(cases, desc="top-k A/B"):
        gen = torch.Generator(device="cuda").manual_seed(L * 1000 + B)
        logits = torch.randn(B, L, device="cuda", generator=gen)
        lengths = (L - torch.randint(0, L // 8 + 1, (B,), device="cuda", generator=gen)).int()   # decode rows
        for method in args.methods:
            outs, times = {}, {}
            for tag, module in (("", dsa_indexer), ("-before", before)):
                out = torch.full((B, args.k), -7, dtype=torch.int32, device="cuda")

                def call(module=module, out=out):
                    return module.indexer_topk(logits, args.k, lengths, out=out, method=method)

                call()
                outs[tag] = out.clone()
                times[tag] = graph_time_us([call] * 8)
                rows.append({"suite": "dsa_indexer_ab", "implementation": f"glm5lab-triton-{method}{tag}",
                             "shape": f"B{B}_L{L}_K{args.k}", "dtype": "float32", "layout": "rows",
                             "metric": "topk_time_graph", "value": times[tag], "unit": "us"})
                if args.timeline:
                    per_kernel, gaps = kernel_timeline([call] * 8)
                    timed, impl = rows[-1], f"glm5lab-triton-{method}{tag}"
                    rows += [{**timed, "implementation": f"{impl}:{name[:60]}", "metric": "kernel_time_in_graph",
                              "value": us} for name, us in per_kernel.items()]
                    rows.append({**timed, "metric": "graph_gap_time", "value": gaps})
                    tqdm.write(f"  {impl} B{B} L{L}: gaps {gaps:.1f} us, " + ", ".join(
                        f"{name[:28]} {us:.1f}" for name, us in per_kernel.items()))
            if not torch.equal(outs[""], outs["-before"]):
                raise Glm5labError(f"{method} at B{B} L{L}: this tree's output differs from --before's")
            now, old = times[""], times["-before"]
            tqdm.write(f"{method:6s} B{B:<4d} L{L:<6d} before {old:8.1f} us  now {now:8.1f} us  "
                       f"before/now {old / now:5.2f}")
    append_rows(args.out, rows, command=command)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
