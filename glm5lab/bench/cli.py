"""`glm5lab bench --suite full|cpu`: the one measurement entry point (notebook 06).

    glm5lab bench --suite full      # on the GPU (H200): ~7 minutes, rows under results/bench/gpu/
    glm5lab bench --suite cpu       # tiny shapes, Triton interpreter: exercises every code path;
                                    # its timings are NOT performance (rows under results/bench/cpu/)
    glm5lab bench --suite full --targets   # issue 7's speed targets against the last kernels run, met or not
    glm5lab bench --suite full --headline  # the README's kernel table, from the same run
"""
from __future__ import annotations

from pathlib import Path


def _gpu_kernels_csv(results: Path) -> Path:
    """The GPU kernel benchmark CSV under `results`; a clear error, not a traceback, when there is none."""
    from glm5lab.bench.suites import out_dir
    from glm5lab.errors import Glm5labError

    csv = out_dir(results, "gpu") / "kernels.csv"
    if not csv.exists():
        raise Glm5labError(f"no GPU kernel benchmark at {csv}: run `glm5lab bench --suite full --parts kernels` "
                           "on a GPU first (the cpu suite's interpreter timings are not judged against targets)")
    return csv


def print_targets(results: Path) -> None:
    """Issue 7's targets against the last GPU kernels run under `results` (kernel_plots.targets_table)."""
    import pandas as pd

    from glm5lab.bench.kernel_plots import targets_table
    from glm5lab.errors import Glm5labError

    csv = _gpu_kernels_csv(results)
    t = targets_table(csv)
    if not t.attrs:
        raise Glm5labError(f"{csv} holds no benchmark run: run `glm5lab bench --suite full --parts kernels` again")
    board = t.attrs.get("gpu_uuid")
    board = f" ({board})" if isinstance(board, str) and board else ""      # (runs before the column: no UUID)
    print(f"issue 7's targets, {t.attrs['gpu']}{board}, commit {t.attrs['git_sha']}, {t.attrs['timestamp']} ({csv}):")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(t.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(f"met {int(t.met.eq(True).sum())} of {len(t)}; unmeasured {int(t.met.isna().sum())}")


def print_headline(results: Path) -> None:
    """The README's kernel table (kernel_plots.headline_table) of the last GPU kernels run under `results`."""
    from glm5lab.bench.kernel_plots import headline_table, last_run
    from glm5lab.errors import Glm5labError

    csv = _gpu_kernels_csv(results)
    if not last_run(csv)[1]:
        raise Glm5labError(f"{csv} holds no benchmark run: run `glm5lab bench --suite full --parts kernels` again")
    print(headline_table(csv))


def _run(args) -> int:
    from glm5lab.bench.suites import run_suite
    from glm5lab.env import default_results_dir

    args.results = args.results or default_results_dir()
    if args.targets or args.headline:
        if args.suite != "full":
            from glm5lab.errors import Glm5labError
            raise Glm5labError(f"--{'targets' if args.targets else 'headline'} reads a GPU run: use it with "
                               "--suite full")
        (print_targets if args.targets else print_headline)(args.results)
        return 0
    df = run_suite(args.suite, args.results, parts=args.parts, budget_s=args.budget,
                   isolate=not args.in_process, progress=not args.no_progress)
    failed = df[df["value"] != 1.0]
    for r in failed.itertuples():
        print(f"  part {r.implementation}: {r.unit}")
    if args.suite == "full" and "kernels" in set(df["implementation"]) and \
            "kernels" not in set(failed["implementation"]):
        print_targets(args.results)
    return 0 if failed.empty else 3


def add_command(sub) -> None:
    from glm5lab.bench.suites import PART_NAMES

    p = sub.add_parser("bench", help="benchmarks and accuracy (notebook 06): --suite full on a GPU, cpu for CI")
    p.add_argument("--suite", choices=("full", "cpu"), required=True,
                   help="full: the H200 run (profile gpu); cpu: tiny shapes under the interpreter")
    p.add_argument("--parts", nargs="+", choices=PART_NAMES, default=None,
                   help=f"run only these parts (default: all, in order: {' '.join(PART_NAMES)})")
    p.add_argument("--results", "--results-dir", type=Path, default=None,
                   help="results folder (default: the checkout's results/, else ./results)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole suite (default 420 for full, 1200 for cpu); parts that "
                        "need device time are skipped once it is spent")
    p.add_argument("--in-process", action="store_true",
                   help="run parts in this process instead of one child process each (no isolation)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--targets", action="store_true",
                   help="run nothing: print issue 7's speed targets against the last GPU kernels run, met or not")
    p.add_argument("--headline", action="store_true",
                   help="run nothing: print the README's kernel table (markdown) from the last GPU kernels run")
    p.set_defaults(func=_run)
