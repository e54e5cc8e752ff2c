"""`glm5lab bench --suite full|cpu`: every measurement of notebook 06 in one call, each part isolated.

Suite "full" (profile gpu) is the H200 run: it must finish in ONE device call (~8 minutes), so every part
has a time cap, the parts that use the GPU share a 420 s budget (then only the projection and the plots,
<= 45 s each, still run; worst case ~8.3 min, expected ~6-7), parts run in order of importance, and each part runs in its own Python process: a part
that fails (an exception, a CUDA error that poisons the context, a hang past its cap) is logged as a row
in suite.csv and the next part still runs. Suite "cpu" (profile cpu) runs the same parts at tiny shapes
under the Triton interpreter so CI exercises every code path; its timings are labeled non-performance.

Output: results/bench/<profile>/<part>.csv (long format, glm5lab.bench.records), suite.csv (one status row
per part), plots/*.png (drawn from the CSVs). Every row's `command` column carries `run=<id>`, so
readers can pick the latest run out of the appended history (`latest_run`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from glm5lab.bench import records

SUITES = {"full": "gpu", "cpu": "cpu"}


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    cap_s: dict          # profile -> seconds (hard cap for the part's process)
    needs_gpu_time: bool = True


# Order = priority under the budget. This notebook's own measurements first; the kernel and indexer
# microbenchmarks (whose owners also keep their own runs) next; the attention stack last, because it sweeps
# its shape list (most informative shapes first) until its share of the budget is spent.
PARTS = [
    Part("kernel_accuracy", "every implementation vs the float64 reference, per dtype/layout",
         {"gpu": 60, "cpu": 120}),
    Part("model_accuracy", "tiny GLM-5: glm5lab decode path (GGUF) vs transformers", {"gpu": 90, "cpu": 300}),
    Part("gemm_streaming", "bf16 GEMM weight-streaming efficiency (projection input)", {"gpu": 30, "cpu": 30}),
    Part("kernels", "sparse-MLA kernel benchmark (kernel helper): glm5lab vs FlashMLA vs torch",
         {"gpu": 450, "cpu": 240}),      # (gpu: 214-224 s on a cold H200 in v15, > 255 s in v16, 269 s in v31; v32:
                                        # killed at 285 s two-thirds through -- compile time; 67 s warm)
    Part("indexer", "DSA indexer benchmark (indexer helper): Triton vs torch", {"gpu": 150, "cpu": 240}),
    Part("attention_stack", "GLM-5-shaped attention layer decode steps at real widths", {"gpu": 110, "cpu": 120}),
    Part("projection", "8x RTX PRO 6000 Blackwell roofline PROJECTION", {"gpu": 45, "cpu": 60}, False),
    Part("plots", "plots drawn from the CSVs", {"gpu": 45, "cpu": 60}, False),
]
PART_NAMES = [p.name for p in PARTS]


def out_dir(results_dir: str | Path, profile: str) -> Path:
    return Path(results_dir) / "bench" / profile


def _log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------- parts
SUITE_INTERLEAVE_ROUNDS = 15


def part_kernels(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench import kernel_bench

    # on the GPU the headline pair (glm5lab's default, FlashMLA) is timed again in interleaved rounds, so the suite's
    # ratios to FlashMLA are taken round by round (NOTES.md v21)
    kw = ({"heads": (8,), "tokens": (2,)} if profile == "cpu" else
          {"interleave": SUITE_INTERLEAVE_ROUNDS, "interleave_impls": ("glm5lab", "flashmla")})
    kernel_bench.run(str(csv), profile, command=cmd, **kw)


def part_indexer(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench import indexer_bench

    kw = {"contexts": (64,), "batches": (1,)} if profile == "cpu" else {}
    indexer_bench.run(str(csv), profile, command=cmd, **kw)


def part_kernel_accuracy(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench.accuracy import kernel_accuracy
    from glm5lab.bench.records import append_rows

    append_rows(csv, kernel_accuracy(profile, log=_log, time_budget_s=budget * 0.8), command=cmd)


def part_model_accuracy(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench.accuracy import MODEL_PROFILES, model_accuracy
    from glm5lab.bench.records import append_rows

    qtypes = list(MODEL_PROFILES[profile]["variants"])
    for i, qt in enumerate(qtypes):   # rows land per GGUF type, so a part killed at its cap keeps its work
        append_rows(csv, model_accuracy(profile, log=_log, qtypes=(qt,), dense_check=(i == len(qtypes) - 1)),
                    command=cmd)


def part_attention_stack(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench.attention_stack import run_rows
    from glm5lab.bench.records import append_rows

    append_rows(csv, run_rows(profile, time_budget_s=max(5.0, budget - 25), log=_log), command=cmd)


def part_gemm_streaming(csv: Path, profile: str, cmd: str, budget: float) -> None:
    """x [B, 6144] @ W^T, W [24576, 6144] bf16 (302 MB): bytes moved / time / copy bandwidth. The weight
    -streaming efficiency the projection applies to GLM-5's weights (a bf16 GEMM; vLLM's GGUF dequant
    GEMMs may do worse, which the projection states)."""
    import torch

    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import bench, copy_bandwidth_gbps

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = (24576, 6144) if dev == "cuda" else (256, 128)
    w = torch.randn(n, k, device=dev).to(torch.bfloat16)
    bw = copy_bandwidth_gbps()
    rows = []
    if bw:
        rows.append({"suite": "gemm_streaming", "implementation": "copy", "shape": "2GiB", "dtype": "uint8",
                     "layout": "-", "metric": "copy_bandwidth", "value": bw, "unit": "GB/s"})
    for B in (1, 8, 32, 64, 128, 256):
        x = torch.randn(B, k, device=dev).to(torch.bfloat16)
        t = bench(lambda: x @ w.T) if dev == "cuda" else bench(lambda: x @ w.T, cpu_reps=1)
        nbytes = 2 * (n * k + B * k + B * n)
        base = {"suite": "gemm_streaming", "implementation": "torch-bf16-gemm", "shape": f"B{B}_N{n}_K{k}",
                "dtype": "bf16", "layout": "-"}
        rows.append({**base, "metric": "time", "value": t["p50"], "unit": "us", **t})
        gbps = nbytes / (t["p50"] * 1e-6) / 1e9
        rows.append({**base, "metric": "bandwidth", "value": gbps, "unit": "GB/s"})
        if bw:
            rows.append({**base, "metric": "fraction_of_copy", "value": gbps / bw, "unit": "fraction"})
        _log(f"  gemm B={B:4d}: {t['p50']:9.1f} us  {gbps:7.0f} GB/s" + (f"  {gbps / bw:.2f} of copy" if bw else ""))
    append_rows(csv, rows, command=cmd)


def part_projection(csv: Path, profile: str, cmd: str, budget: float) -> None:
    """Always fed from GPU measurements (results/bench/gpu/), whichever profile runs it: CPU timings are
    never an input. Missing inputs are written as rows that name them."""
    from glm5lab.bench.projection import assumptions, inputs_measured_on, project, projection_rows
    from glm5lab.bench.records import append_rows

    results = csv.parents[2]
    proj = project(results_dir=results)
    append_rows(csv, projection_rows(proj), command=cmd)
    from glm5lab.bench.records import provenance
    from glm5lab.files import write_table

    write_table(assumptions(measured_on=inputs_measured_on(proj)).assign(**provenance(cmd)),
                csv.parent / "projection_assumptions.csv")
    ok = proj[(proj.kind == "projection") & proj.tokens_per_s.notna()] if "tokens_per_s" in proj else proj.iloc[:0]
    _log(f"  projection: {len(ok)} projected points; "
         f"{'missing inputs: ' + proj[proj.kind == 'projection'].missing_inputs.iloc[0] if ok.empty else 'all inputs measured'}")


def part_plots(csv: Path, profile: str, cmd: str, budget: float) -> None:
    from glm5lab.bench.plots import draw_all

    for p in draw_all(csv.parent, profile):
        _log(f"  plot {p}")


PART_FUNCS: dict[str, Callable] = {
    "kernels": part_kernels, "indexer": part_indexer, "kernel_accuracy": part_kernel_accuracy,
    "model_accuracy": part_model_accuracy, "attention_stack": part_attention_stack,
    "gemm_streaming": part_gemm_streaming, "projection": part_projection, "plots": part_plots,
}


def suite_invocation(suite: str, parts: list[str] | None = None, budget_s: float | None = None) -> str:
    """The glm5lab command a suite run amounts to: every row's `command` starts with it. GLM5LAB_OUTER_COMMAND (set by
    scripts/gpu_run.sh) names what ran it, so a row says how to run it again."""
    cmd = f"glm5lab bench --suite {suite}" + (" --parts " + " ".join(parts) if parts else "") + \
        (f" --budget {budget_s:.0f}" if budget_s is not None else "")
    outer = os.environ.get("GLM5LAB_OUTER_COMMAND", "").strip()
    return cmd + (f" (via {outer})" if outer else "")


def run_part(name: str, profile: str, results_dir: str | Path, run_id: str, budget: float,
             invocation: str | None = None) -> int:
    """Run one part in THIS process; 0 on success. Used by the isolated child and by tests."""
    if profile == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("GLM5LAB_BENCH_INJECT_FAILURE") == name:   # fault injection for the isolation test
        raise RuntimeError(f"injected failure of part {name!r} (GLM5LAB_BENCH_INJECT_FAILURE)")
    from glm5lab.files import make_folder

    d = out_dir(results_dir, profile)
    make_folder(d)
    suite = "full" if profile == "gpu" else "cpu"
    cmd = f"{invocation or suite_invocation(suite)} part={name} run={run_id}" + \
        (" (cpu profile: timings are NOT performance)" if profile == "cpu" else "")
    PART_FUNCS[name](d / f"{name}.csv", profile, cmd, budget)
    return 0


# ---------------------------------------------------------------------------------------- suite
def _status_row(name, status, value, wall, why, run_id, suite) -> dict:
    return {"suite": "bench_suite", "implementation": name, "shape": "-", "dtype": "-", "layout": "-",
            "metric": "part_status", "value": value, "unit": f"{status}: {why}"[:400] if why else status,
            "p50": wall}


def run_suite(suite: str, results_dir: str | Path = "results", *, parts: list[str] | None = None,
              budget_s: float | None = None, isolate: bool = True, progress: bool = True) -> "object":
    """Run the parts of `suite` in order; returns a pandas DataFrame of part statuses (also in suite.csv)."""
    import pandas as pd

    from glm5lab.bench.records import append_rows
    from glm5lab.errors import Glm5labError

    if suite not in SUITES:
        raise Glm5labError(f"unknown suite {suite!r}; expected one of {sorted(SUITES)}")
    from glm5lab.files import make_folder, require_folder_target

    require_folder_target(results_dir)
    profile = SUITES[suite]
    if profile == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise Glm5labError("suite 'full' measures on a GPU and none is visible; use --suite cpu")
    chosen = parts or PART_NAMES
    unknown = [p for p in chosen if p not in PART_NAMES]
    if unknown:
        raise Glm5labError(f"unknown part(s) {unknown}; parts are {PART_NAMES}")
    budget_s = budget_s if budget_s is not None else (420.0 if profile == "gpu" else 1200.0)
    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    invocation = suite_invocation(suite, parts, budget_s)
    d = out_dir(results_dir, profile)
    make_folder(d)
    t0 = time.time()
    statuses = []
    todo = [p for p in PARTS if p.name in chosen]
    try:
        from tqdm import tqdm

        bar = tqdm(todo, desc=f"bench {suite}", unit="part", disable=not progress, file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = todo
    for part in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(part.name)
        left = budget_s - (time.time() - t0)
        cap = part.cap_s[profile]
        if part.needs_gpu_time and left < 20:
            statuses.append(_status_row(part.name, "skipped", float("nan"), 0.0,
                                        f"suite budget of {budget_s:.0f} s spent", run_id, suite))
            _log(f"[{part.name}] skipped: suite budget spent")
            continue
        limit = min(cap, left) if part.needs_gpu_time else cap
        _log(f"[{part.name}] {part.what} (cap {limit:.0f} s)")
        ts = time.time()
        status, why = "ok", ""
        if isolate:
            argv = [sys.executable, "-m", "glm5lab.bench.suites", "--part", part.name, "--profile", profile,
                    "--results", str(results_dir), "--run-id", run_id, "--budget", f"{limit:.0f}",
                    "--invocation", invocation]
            env = dict(os.environ)
            if profile == "cpu":
                env["TRITON_INTERPRET"] = "1"
            try:
                rc = subprocess.run(argv, env=env, timeout=limit + 15).returncode
                if rc != 0:
                    status, why = "failed", f"exit code {rc} (traceback above in the log)"
            except subprocess.TimeoutExpired:
                status, why = "timeout", f"killed after {limit + 15:.0f} s"
        else:
            try:
                run_part(part.name, profile, results_dir, run_id, limit, invocation)
            except Exception as exc:  # noqa: BLE001  (a failing part must not stop the others)
                traceback.print_exc()
                status, why = "failed", f"{type(exc).__name__}: {exc}"
        wall = time.time() - ts
        _log(f"[{part.name}] {status} in {wall:.0f} s" + (f": {why}" if why else ""))
        statuses.append(_status_row(part.name, status, 1.0 if status == "ok" else 0.0, wall, why, run_id, suite))
    cmd = f"{invocation} run={run_id}" + (" (cpu profile: timings are NOT performance)" if profile == "cpu" else "")
    append_rows(d / "suite.csv", statuses, command=cmd)
    _log(f"bench {suite}: {sum(s['value'] == 1.0 for s in statuses)}/{len(statuses)} parts ok in "
         f"{time.time() - t0:.0f} s; results in {d}")
    frame = pd.DataFrame(statuses)
    frame["command"] = cmd
    return frame


def _run_ids(df):
    """Each row's run id, from the run=<id> tag of its `command` (NaN where it has none)."""
    return df["command"].astype(str).str.extract(r"run=(\S+)")[0]


def run_id_of(status) -> str | None:
    """The run id of a suite's status rows (run_suite's result, or suite.csv's latest run)."""
    if status is None or status.empty or "command" not in status:
        return None
    ids = _run_ids(status).dropna()
    return ids.iloc[-1] if not ids.empty else None


def read_part(results_dir: str | Path, profile: str, part: str, status):
    """A part's rows as the notebook shows them beside the status rows of one suite run: that run's rows when the
    run had the part (none when it failed there: an earlier run's numbers must not pass for this one's), else the
    latest run's (a run of some parts leaves the others' last results standing). attrs["run"] names the run."""
    run = run_id_of(status)
    ran = status is not None and not status.empty and part in set(status["implementation"])
    df = read_results(results_dir, profile, part, run=run if ran else None)
    if not ran and not df.empty:
        run = run_id_of(df)
    df.attrs["run"] = run
    return df


def require_parts_passed(status) -> None:
    """Raise (one line naming each) when a part of this run failed or timed out: the main job must not end green
    on a failed measurement. A part skipped for the suite's time budget is not a failure."""
    from glm5lab.errors import Glm5labError

    if status is None or status.empty:
        return
    bad = status[status["unit"].astype(str).str.startswith(("failed", "timeout"))]
    if not bad.empty:
        raise Glm5labError(f"bench run {run_id_of(status)}: " + "; ".join(
            f"{r.implementation} {r.unit}" for r in bad.itertuples()) + " (the tables above show this run only)")


def latest_run(df):
    """Rows of the most recent run in an appended CSV (by the run=<id> tag in `command`)."""
    if df is None or df.empty or "command" not in df:
        return df
    ids = _run_ids(df)
    if ids.isna().all():
        return df
    return df[ids == ids.dropna().max()]


def read_results(results_dir: str | Path, profile: str, part: str, latest: bool = True, run: str | None = None):
    """One part's CSV as a DataFrame: the rows of run `run` when given (empty when that run wrote none: a part
    that failed in it must not show an earlier run's rows), else the latest run's, or all with latest=False;
    an empty DataFrame when the CSV is absent."""
    import pandas as pd

    p = out_dir(results_dir, profile) / f"{part}.csv"
    if not p.exists():
        return pd.DataFrame()
    df = records.read(p)
    if run is not None:
        return df[_run_ids(df) == run] if "command" in df else df.iloc[0:0]
    return latest_run(df) if latest else df


def main(argv=None) -> int:
    """Child-process entry: run one part."""
    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.suites")
    ap.add_argument("--part", required=True, choices=PART_NAMES)
    ap.add_argument("--profile", required=True, choices=("gpu", "cpu"))
    ap.add_argument("--results", default="results")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--budget", type=float, default=120.0)
    ap.add_argument("--invocation", default=None, help="the suite's command, for the rows' `command` column")
    a = ap.parse_args(argv)
    return run_part(a.part, a.profile, a.results, a.run_id, a.budget, a.invocation)


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------------- tables for notebook 06
def kernel_speed_table(df):
    """kernel_bench rows -> p50 µs per shape x (implementation, layout), plus roofline fraction of
    glm5lab's kernel; empty when the part did not run."""
    import pandas as pd

    if df is None or df.empty:
        return pd.DataFrame()
    main = ("glm5lab", "flashmla", "virtual-block-table", "torch-gather", "vllm-triton-vbt")  # not tuning variants
    d = df[df.metric.isin(["time", "roofline_fraction"]) & df.implementation.isin(main)].copy()
    d["value"] = pd.to_numeric(d.value, errors="coerce")
    t = d[d.metric == "time"].pivot_table(index="shape", columns=["implementation", "layout"], values="value",
                                          aggfunc="last")
    r = d[(d.metric == "roofline_fraction") & (d.implementation == "glm5lab")].pivot_table(
        index="shape", columns="layout", values="value", aggfunc="last")
    if not r.empty:
        r.columns = pd.MultiIndex.from_tuples([("roofline", c) for c in r.columns])
        t.columns = pd.MultiIndex.from_tuples([(f"{i} µs", l) for i, l in t.columns])
        t = t.join(r)
    return t


def indexer_speed_table(df):
    """indexer_bench rows -> step time (µs) per shape and implementation, and the logits kernel's
    fraction of the copy ceiling; each also from CUDA-graph time where the run has it (`_graph` columns)."""
    import pandas as pd

    if df is None or df.empty:
        return pd.DataFrame()
    metrics = ["step_time", "step_time_graph", "fraction_of_copy_ceiling", "fraction_of_copy_ceiling_graph"]
    d = df[df.metric.isin(metrics)].copy()
    d["value"] = pd.to_numeric(d.value, errors="coerce")
    return d.pivot_table(index=["dtype", "shape"], columns=["metric", "implementation"], values="value",
                         aggfunc="last")
