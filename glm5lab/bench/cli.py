"""`glm5lab bench --suite full|cpu`: the one measurement entry point (notebook 06).

    glm5lab bench --suite full      # on the GPU (H200): ~7 minutes, rows under results/bench/gpu/
    glm5lab bench --suite cpu       # tiny shapes, Triton interpreter: exercises every code path;
                                    # its timings are NOT performance (rows under results/bench/cpu/)
"""
from __future__ import annotations

from pathlib import Path


def _run(args) -> int:
    from glm5lab.bench.suites import run_suite

    df = run_suite(args.suite, args.results, parts=args.parts, budget_s=args.budget,
                   isolate=not args.in_process, progress=not args.no_progress)
    failed = df[df["value"] != 1.0]
    for r in failed.itertuples():
        print(f"  part {r.implementation}: {r.unit}")
    return 0 if failed.empty else 3


def add_command(sub) -> None:
    from glm5lab.bench.suites import PART_NAMES

    p = sub.add_parser("bench", help="benchmarks and accuracy (notebook 06): --suite full on a GPU, cpu for CI")
    p.add_argument("--suite", choices=("full", "cpu"), required=True,
                   help="full: the H200 run (profile gpu); cpu: tiny shapes under the interpreter")
    p.add_argument("--parts", nargs="*", choices=PART_NAMES, default=None,
                   help=f"run only these parts (default: all, in order: {' '.join(PART_NAMES)})")
    p.add_argument("--results", type=Path, default=Path("results"), help="results folder (default: results/)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole suite (default 420 for full, 1200 for cpu); parts that "
                        "need device time are skipped once it is spent")
    p.add_argument("--in-process", action="store_true",
                   help="run parts in this process instead of one child process each (no isolation)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
