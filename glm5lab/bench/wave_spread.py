"""When each program of a kernel's grid starts and ends, and on which SM: what a call's last programs cost it.

A call lasts until its LAST program ends. At 128 tokens the dual fp8_ds_mla kernel runs one program a SM, all
started together (one wave); at 512 tokens the paired kernel runs two a SM, 512 programs in ~two waves of 264. Any
SM-time between a program's end and the call's end is time the roofline counts and no program uses (issue 7's
one-wave and 512-token targets). With `_config={"impl": "gluon", "_stamps": (buf, None)}` those kernels write
globaltimer at each program's start and end and the id of its SM (`sparse_mla_sm90.WAVE_STAMPS`); this replays a
CUDA graph of rotating input sets, reads every call's stamps and reports, per form and shape (medians over the
calls): the programs' end times (p10 / p50 / p90 / last) from the call's first start, the tail (last end - median
end), how full the program slots were over the call (`occupancy`) and for how long fewer than 90% of the GPU's slots
were busy at the end (`drain_us`). The programs of one call are kept for the plot (`plot`).

    PYTHONPATH=. python -m glm5lab.bench.wave_spread --out results/kernels/wave_spread_h200.csv \\
        --programs results/kernels/wave_spread_programs_h200.csv.gz --png results/kernels/wave_spread_h200.png
    python -m glm5lab.bench.wave_spread --pairs results/kernels/wave_spread_programs_h200.csv.gz   # no GPU
"""
from __future__ import annotations

import argparse
import statistics
import sys

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.files import save_figure

SUITE = "sparse_mla_wave"
# (heads, tokens, form): the defaults at one wave (128 tokens: the dual kernel) and at ~two waves of the paired
# kernel (512 tokens), each beside its gathers alone (a timing diagnostic: kernel_bench.GLUON_VARIANTS)
DEFAULT_CASES = ((8, 128, "glm5lab"), (8, 128, "ws8x2esopd3"), (16, 128, "glm5lab"), (16, 128, "ws8x2sod3"),
                 (8, 512, "glm5lab"), (8, 512, "pair8sopd3"), (16, 512, "glm5lab"), (16, 512, "pair16sopd3"))


def programs_of(stamps) -> list:
    """(sm, start_ns, end_ns) of each program that ran, from a wave-stamp buffer's rows ([programs, STAMP_SLOTS]
    int64 as the kernel wrote them; rows left at -1 by programs that did not run are dropped)."""
    return [(int(r[1]), int(r[0]), int(r[13])) for r in stamps if r[0] >= 0 and r[13] >= 0]


def active_at(programs, t_ns: float) -> int:
    """How many of `programs` ((sm, start, end)) run at time t_ns."""
    return sum(1 for _, a, b in programs if a <= t_ns < b)


def spread_parts(programs, slots: int) -> dict:
    """One call's wave metrics (us from its first program's start): program count, the last start, end quantiles,
    the tail (last end - median end), `occupancy` (program time over slots x the call's span: 1.0 when every slot
    of the GPU -- SMs x programs resident a SM -- is busy from the first start to the last end) and `drain_us` (from
    when fewer than 90% of the slots last ran programs to the call's end; 0 when they never were that full)."""
    if not programs:
        raise Glm5labError("wave stamps: no program of the call wrote its stamps")
    if slots < 1:
        raise Glm5labError(f"wave stamps: slots must be >= 1, got {slots}")
    t0 = min(a for _, a, _ in programs)
    end = max(b for _, _, b in programs)
    ends = sorted((b - t0) / 1e3 for _, _, b in programs)
    q = statistics.quantiles(ends, n=10, method="inclusive") if len(ends) > 1 else [ends[0]] * 9
    span = (end - t0) / 1e3
    busy = sum(b - a for _, a, b in programs) / 1e3
    # the last moment (a program's start or end) at which >= 90% of the slots ran programs
    marks = sorted({a for _, a, _ in programs} | {b for _, _, b in programs})
    full = [t for t in marks if active_at(programs, t) >= 0.9 * slots]
    drain = (end - max(full)) / 1e3 if full else 0.0
    return {"programs": float(len(programs)), "sms": float(len({sm for sm, _, _ in programs})),
            "last_start_us": max(a - t0 for _, a, _ in programs) / 1e3, "end_p10_us": q[0],
            "end_p50_us": statistics.median(ends), "end_p90_us": q[8], "end_last_us": span,
            "tail_us": span - statistics.median(ends), "occupancy": busy / (slots * span) if span > 0 else 0.0,
            "drain_us": drain}


def program_rows(programs, form: str, shape: str, slots: int) -> list:
    """One call's programs ((sm, start_ns, end_ns)) as rows of the programs CSV (`write_programs`, `plot`): us from
    the call's first start."""
    t0 = min(a for _, a, _ in programs)
    return [{"implementation": form, "shape": shape, "slots": slots, "program": i, "sm": sm,
             "start_us": (a - t0) / 1e3, "end_us": (b - t0) / 1e3} for i, (sm, a, b) in enumerate(programs)]


def resident_pairs(programs) -> list:
    """The programs each SM ran, in the order they started, taken two at a time (the paired kernel holds two a SM,
    so pair k is the k-th "wave" of that SM): (sm, wave, younger / older duration, start gap us) a pair, the older
    being the one that started first (ties: the lower program index). An SM's odd program out is left out. v44-v45
    read it to ask whether the CTA that came second is the one that runs slower (NOTES.md v45)."""
    by_sm: dict = {}
    for i, (sm, a, b) in enumerate(programs):
        if b <= a:
            raise Glm5labError(f"wave stamps: program {i} on SM {sm} ends ({b} ns) before it starts ({a} ns)")
        by_sm.setdefault(sm, []).append((a, i, b))
    pairs = []
    for sm in sorted(by_sm):
        runs = sorted(by_sm[sm])
        for wave in range(len(runs) // 2):
            (a0, _, b0), (a1, _, b1) = runs[2 * wave], runs[2 * wave + 1]
            pairs.append((sm, wave + 1, (b1 - a1) / (b0 - a0), (a1 - a0) / 1e3))
    return pairs


def pair_table(programs_csv: str):
    """`resident_pairs` of every call in a programs CSV (`write_programs`): a row a call (form, shape, its run's
    timestamp) and wave, with how many SMs, on what share the younger program took longer, and the younger / older
    duration's p10 / p50 / p90 and the median start gap. A pandas DataFrame (printed by `--pairs`)."""
    import pandas as pd

    frame = pd.read_csv(programs_csv, dtype={"git_sha": str})
    # a call's programs are numbered from 0 (`program_rows`): a 0 starts the next call of that form and shape
    frame["call"] = frame.groupby(["implementation", "shape"])["program"].transform(lambda p: (p == 0).cumsum())
    out = []
    for (form, shape, _), sub in frame.groupby(["implementation", "shape", "call"], sort=False):
        progs = list(zip(sub["sm"], (sub["start_us"] * 1e3).round(), (sub["end_us"] * 1e3).round()))
        pairs = pd.DataFrame(resident_pairs(progs), columns=["sm", "wave", "ratio", "gap_us"])
        for wave, w in pairs.groupby("wave"):
            out.append({"implementation": form, "shape": shape, "timestamp": sub["timestamp"].iloc[0],
                        "wave": int(wave), "sms": len(w), "younger_slower": float((w["ratio"] > 1).mean()),
                        "ratio_p10": w["ratio"].quantile(0.1), "ratio_p50": w["ratio"].median(),
                        "ratio_p90": w["ratio"].quantile(0.9), "gap_p50_us": w["gap_us"].median()})
    return pd.DataFrame(out)


def summary_rows(calls: list, shape: str, form: str) -> list:
    """Long-format rows: each `spread_parts` metric's median over the calls, with p20 / p80."""
    from glm5lab.bench.timing import quantiles

    rows = []
    for metric in calls[0]:
        qs = quantiles([c[metric] for c in calls])
        unit = "us" if metric.endswith("_us") else ("fraction" if metric == "occupancy" else "count")
        rows.append({"suite": SUITE, "implementation": form, "shape": shape, "dtype": "bf16", "layout": "fp8_ds_mla",
                     "metric": metric, "value": qs["p50"], "unit": unit, **qs})
    return rows


def run(out_csv: str, programs_csv: str | None = None, cases=DEFAULT_CASES, topk: int = 2048,
        num_slots: int = 524288, replays: int = 3, command: str = "", verbose: bool = True) -> list:
    """Every (heads, tokens, form[, splits]) case ("glm5lab": the default; else a name of
    kernel_bench.GLUON_VARIANTS; splits: the top-k split in that many programs a token, merged after, else the
    default's): a CUDA graph of rotating input sets, each call with its own stamp buffer, replayed `replays` times;
    the last replay's stamps give every call's `spread_parts`; rows appended to out_csv, and one call's programs (the
    median-tail one) to programs_csv. The graph's time a call is recorded beside them (`time_graph_stamped`), and the
    same calls' without stamps (`time_graph`): the stamped build is not byte-identical (NOTES.md v44)."""
    import torch
    from tqdm.auto import tqdm

    from glm5lab.bench.kernel_bench import GLUON_VARIANTS, graph_timer, input_sets, median_us, rotating_sets
    from glm5lab.bench.power_probe import random_fp8_cache
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import need_gpu
    from glm5lab.kernels.sparse_mla import STAMP_SLOTS, sparse_mla_attention
    from glm5lab.kernels.sparse_mla_sm90 import default_config
    from glm5lab.sparse.reference import mla_softmax_scale

    known = dict(GLUON_VARIANTS)
    cases = [(*c, None) if len(c) == 3 else tuple(c) for c in cases]
    unknown = sorted({c[2] for c in cases if c[2] != "glm5lab" and c[2] not in known})
    if unknown:
        raise Glm5labError(f"unknown form(s) {unknown}; expected 'glm5lab' or names from kernel_bench.GLUON_VARIANTS")
    bad = [c[3] for c in cases if c[3] is not None and not 1 <= c[3] <= 16]
    if bad:
        raise Glm5labError(f"splits must be 1-16 (the stamp buffer's programs a token), got {bad}")
    need_gpu("the wave stamps")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(44)
    cache = random_fp8_cache(num_slots, gen)
    scale = mla_softmax_scale()
    rows, kept = [], []
    for heads, tokens, form, splits in tqdm(cases, desc="wave stamps", disable=not verbose):
        cfg = {**({} if form == "glm5lab" else known[form]), "impl": "gluon"}
        tile = {**default_config(heads, True, tokens, num_sms), **cfg}
        slots = num_sms * tile.get("resident", 1)
        sets = input_sets(tokens, heads, topk, num_slots, max(8, rotating_sets(tokens, topk)), gen)
        bufs = [torch.full((tokens * 16, STAMP_SLOTS.value), -1, dtype=torch.int64, device="cuda") for _ in sets]
        plain = graph_timer([lambda q=q, s=s: sparse_mla_attention(q, cache, s, scale, num_splits=splits, _config=cfg)
                             for q, s in sets])
        timer = graph_timer([lambda q=q, s=s, b=b: sparse_mla_attention(q, cache, s, scale, num_splits=splits,
                                                                        _config={**cfg, "_stamps": (b, None)})
                             for (q, s), b in zip(sets, bufs)], replays)
        us, plain_us = median_us(timer, 3), median_us(plain, 3)
        torch.cuda.synchronize()
        per_call = [programs_of(b.tolist()) for b in bufs]
        calls = [spread_parts(p, slots) for p in per_call]
        shape = f"H{heads}_T{tokens}_K{topk}" + (f"_S{splits}" if splits else "")
        rows += summary_rows(calls, shape, form)
        rows += [{"suite": SUITE, "implementation": form, "shape": shape, "dtype": "bf16", "layout": "fp8_ds_mla",
                  "metric": metric, "value": v, "unit": "us"}
                 for metric, v in (("time_graph_stamped", us), ("time_graph", plain_us))]
        pick = sorted(range(len(calls)), key=lambda i: calls[i]["tail_us"])[len(calls) // 2]
        kept += program_rows(per_call[pick], form, shape, slots)
        if verbose:
            med = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
            tqdm.write(f"  {shape} {form:>12}: graph {plain_us:.1f} us (stamped {us:.1f}); "
                       + " ".join(f"{k} {v:.3g}" for k, v in med.items()))
    append_rows(out_csv, rows, command=command or "python -m glm5lab.bench.wave_spread")
    if programs_csv:
        write_programs(programs_csv, kept, command or "python -m glm5lab.bench.wave_spread")
    return rows


def write_programs(path: str, programs: list, command: str) -> None:
    """One call's programs a case, with the provenance of `records.provenance`, appended to a (gzip) CSV."""
    from pathlib import Path

    import pandas as pd

    from glm5lab.bench.records import provenance
    from glm5lab.files import write_table

    frame = pd.DataFrame(programs)
    for k, v in provenance(command).items():
        frame[k] = v
    path = Path(path)
    old = pd.read_csv(path, dtype=str) if path.exists() else None
    out = frame if old is None else pd.concat([old, frame.astype(str)], ignore_index=True)
    write_table(out, path)


def plot(programs_csv: str, png: str) -> str:
    """Programs running over time (one line a case: the latest run's, i.e. the rows of the last row's command and
    commit) and each program's end by SM, from the programs CSV; returns png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frame = pd.read_csv(programs_csv, dtype={"git_sha": str})
    frame = frame[frame["command"] == frame["command"].iloc[-1]]
    frame = frame[frame["git_sha"] == frame["git_sha"].iloc[-1]]        # (the latest run: its command and commit)
    cases = list(dict.fromkeys(zip(frame["shape"], frame["implementation"])))
    shapes = list(dict.fromkeys(s for s, _ in cases))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.2 * len(shapes), 7), squeeze=False)
    for col, shape in enumerate(shapes):
        for form in [f for s, f in cases if s == shape]:
            sub = frame[(frame["shape"] == shape) & (frame["implementation"] == form)]
            progs = list(zip(sub["sm"], sub["start_us"], sub["end_us"]))
            marks = sorted(set(sub["start_us"]) | set(sub["end_us"]))
            label = form.replace("glm5lab", "default") + (" (gathers alone)" if form.endswith("d3") else "")
            axes[0][col].step(marks, [active_at(progs, t) / sub["slots"].iloc[0] for t in marks], where="post",
                              label=label)
            axes[1][col].scatter(sub["sm"], sub["end_us"], s=4, label=label)
        axes[0][col].set(title=shape, xlabel="us from the call's first start", ylabel="share of program slots busy")
        axes[1][col].set(xlabel="SM id", ylabel="program end (us)")
        axes[0][col].legend(fontsize=7)
    first = frame.iloc[0]
    fig.suptitle(f"When the programs of one call end ({first['gpu']}, git {first['git_sha']}): the call lasts until "
                 "the last one", fontsize=10)
    fig.tight_layout()
    try:
        save_figure(fig, png)
    finally:
        plt.close(fig)
    return png


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.wave_spread", description=first_paragraph(__doc__))
    ap.add_argument("--out", help="the summary CSV (required unless --pairs)")
    ap.add_argument("--programs", help="(gzip) CSV for one call's programs a case")
    ap.add_argument("--png", help="plot the programs CSV into this file")
    ap.add_argument("--pairs", metavar="PROGRAMS_CSV",
                    help="no GPU: print each call's co-resident pairs (`pair_table`) from a programs CSV and stop")
    ap.add_argument("--case", nargs="+", metavar="HEADS:TOKENS:FORM[:SPLITS]",
                    help="cases (default: %s)" % " ".join(f"{h}:{t}:{f}" for h, t, f in DEFAULT_CASES))
    args = ap.parse_args(argv)
    if args.pairs:
        print(pair_table(args.pairs).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        return 0
    if not args.out:
        raise Glm5labError("wave_spread: --out is required (or --pairs PROGRAMS_CSV to read a committed run)")
    cases = DEFAULT_CASES
    if args.case:
        try:
            cases = tuple((int(h), int(t), f, *(int(x) for x in rest))
                          for h, t, f, *rest in (c.split(":") for c in args.case))
            if any(len(c) > 4 for c in cases):
                raise ValueError
        except ValueError:
            raise Glm5labError(f"--case takes HEADS:TOKENS:FORM[:SPLITS], got {args.case}") from None
    run(args.out, args.programs, cases, command=command_line("glm5lab.bench.wave_spread", argv))
    if args.png and args.programs:
        plot(args.programs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
