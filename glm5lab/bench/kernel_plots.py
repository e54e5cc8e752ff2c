"""The roofline picture of the sparse-MLA kernel benchmark, drawn from its long-format CSV (never the other
way round): time per shape against the memory floor, and the fraction of the roofline reached."""
from __future__ import annotations

from pathlib import Path

from glm5lab.bench import records
from glm5lab.files import save_figure

MAIN = [("glm5lab", "bf16"), ("glm5lab", "fp8_ds_mla"), ("flashmla", "bf16"), ("flashmla", "fp8_ds_mla"),
        ("virtual-block-table", "bf16"), ("torch-gather", "bf16")]
STYLE = {("glm5lab", "bf16"): ("C0", "-", "o"), ("glm5lab", "fp8_ds_mla"): ("C0", "--", "s"),
         ("flashmla", "bf16"): ("C3", "-", "o"), ("flashmla", "fp8_ds_mla"): ("C3", "--", "s"),
         ("virtual-block-table", "bf16"): ("C2", ":", "^"), ("torch-gather", "bf16"): ("C7", ":", "v")}
LABEL = {("glm5lab", "bf16"): "glm5lab bf16 KV", ("glm5lab", "fp8_ds_mla"): "glm5lab fp8_ds_mla",
         ("flashmla", "bf16"): "FlashMLA sparse prefill (bf16, heads padded to 64)",
         ("flashmla", "fp8_ds_mla"): "FlashMLA sparse decode (fp8, heads padded to 64)",
         ("virtual-block-table", "bf16"): "virtual block table + paged kernel (notebook 04)",
         ("torch-gather", "bf16"): "torch gather"}


def summary(csv_path):
    """One row per (implementation, layout, shape) of the CSV's last run (last_run: a CSV may hold several, and
    an implementation that failed in the last one must not show an earlier run's numbers under its provenance):
    H, T, every metric as a column, plus provenance."""
    df, _ = last_run(csv_path)
    shapes = df[df.implementation != "copy"]
    wide = shapes.pivot_table(index=["implementation", "layout", "shape"], columns="metric", values="value",
                              aggfunc="last").reset_index()
    hw = wide["shape"].str.extract(r"H(\d+)_T(\d+)_K(\d+)").astype(int)
    wide["H"], wide["tokens"], wide["topk"] = hw[0], hw[1], hw[2]
    for col in ("gpu", "gpu_uuid", "timestamp", "git_sha", "triton_interpret"):
        wide[col] = df[col].iloc[-1] if col in df and len(df) else ""
    copy = df[df.metric == "copy_bandwidth"]["value"]
    wide.attrs["copy_bw_GBps"] = float(copy.iloc[-1]) if len(copy) else float("nan")
    return wide


def roofline_figure(csv_path, out_png=None, time_metric: str = "time_graph"):
    """Figure: per head count, time vs tokens (with the bf16 / fp8 memory floors) and roofline fraction.
    Falls back to the do_bench 'time' metric where the CSV has no CUDA-graph time (CPU runs)."""
    import matplotlib

    matplotlib.use("Agg") if out_png and not _inline() else None
    import matplotlib.pyplot as plt

    w = summary(csv_path)
    if time_metric not in w or w[time_metric].isna().all():
        time_metric = "time"
    bw = w.attrs["copy_bw_GBps"]
    heads = sorted(w.H.unique())
    fig, axes = plt.subplots(2, len(heads), figsize=(4.2 * len(heads), 7.5), squeeze=False)
    for j, H in enumerate(heads):
        ax, ax2 = axes[0][j], axes[1][j]
        sub = w[w.H == H]
        for key in MAIN:
            s = sub[(sub.implementation == key[0]) & (sub.layout == key[1])].sort_values("tokens")
            if s.empty:
                continue
            metric, note = time_metric, ""
            if s[metric].isna().all():        # not graph-timed (torch, the table-building route): do_bench
                metric, note = "time", " [do_bench]"
            if s[metric].isna().all():
                continue
            c, ls, m = STYLE[key]
            ax.plot(s.tokens, s[metric], color=c, ls=ls, marker=m, label=LABEL[key] + note)
            if key[0] in ("glm5lab", "flashmla") and bw == bw:
                ax2.plot(s.tokens, s.min_bytes / (s[metric] * 1e-6) / 1e9 / bw, color=c, ls=ls, marker=m)
        if bw == bw:
            for lay, ls in (("bf16", "-"), ("fp8_ds_mla", "--")):
                s = sub[(sub.implementation == "glm5lab") & (sub.layout == lay)].sort_values("tokens")
                if not s.empty:
                    ax.plot(s.tokens, s.min_bytes / (bw * 1e9) * 1e6, color="k", ls=ls, lw=0.8,
                            label=f"memory floor ({'bf16 1152' if lay == 'bf16' else 'fp8 656'} B/row)")
        ax.set(xscale="log", yscale="log", title=f"{H} heads", xlabel="tokens", ylabel="us")
        ax2.set(xscale="log", ylim=(0, 1.05), xlabel="tokens", ylabel="fraction of memory roofline")
        ax2.axhline(0.85, color="grey", lw=0.6, ls=":")
        ax.grid(alpha=0.3)
        ax2.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    row = w.iloc[0] if len(w) else {}
    how = "CUDA-graph GPU time" if time_metric == "time_graph" else "do_bench time"
    fig.suptitle(f"sparse MLA, top-k {int(w.topk.max()) if len(w) else '?'}, {how}; {row.get('gpu', '?')}, "
                 f"copy {bw:.0f} GB/s; {str(row.get('timestamp', ''))[:16]}, git {row.get('git_sha', '?')}; "
                 f"source {Path(csv_path).name}", fontsize=9)
    fig.tight_layout()
    if out_png:
        save_figure(fig, out_png)
    return fig, w


# issue 7's speed targets: (what, heads, tokens, layout, quantity, at least / at most, goal). "x_fm" is FlashMLA's
# time over glm5lab's (its fp8 decode for fp8_ds_mla, its bf16 sparse prefill for bf16); 128 heads: report only.
ISSUE_TARGETS = ([("1-8 token latency", 8, 1, "fp8_ds_mla", "us", "<=", 6.0),
                  ("1-8 token latency", 8, 8, "fp8_ds_mla", "us", "<=", 8.0)]
                 + [("memory roofline", H, T, lay, "roofline", ">=", 0.85)
                    for H in (8, 16) for T in (128, 512) for lay in ("bf16", "fp8_ds_mla")]
                 + [("x FlashMLA fp8 decode at 512 tokens", H, 512, "fp8_ds_mla", "x_fm", ">=", 2.2) for H in (8, 16)]
                 + [(f"x FlashMLA {'bf16 sparse prefill' if lay == 'bf16' else 'fp8 sparse decode'}", 64, T, lay,
                     "x_fm", ">=", 0.8 if lay == "bf16" else 1.0)
                    for lay in ("bf16", "fp8_ds_mla") for T in (1, 8, 32, 128, 512)])
# where each quantity is read from, best first: the interleaved rounds (ratios to FlashMLA taken round by round), the
# CUDA-graph time of the sequential pass, do_bench
_SOURCES = {"us": [("interleaved", "time_graph_interleaved"), ("graph", "time_graph"), ("do_bench", "time")],
            "roofline": [("interleaved", "roofline_fraction_interleaved"), ("graph", "roofline_fraction_graph"),
                         ("do_bench", "roofline_fraction")],
            "x_fm": [("interleaved", "speedup_vs_flashmla_interleaved"), ("graph", "time_graph"),
                     ("do_bench", "time")]}


def last_run(csv_path):
    """The rows of the LAST run (one append of records.append_rows: one timestamp and command) of a kernel benchmark
    CSV, and its provenance (gpu, git_sha, timestamp; empty when the CSV holds no run); a file that is not a
    benchmark CSV is a Glm5labError."""
    from glm5lab.bench.records import COLUMNS
    from glm5lab.errors import Glm5labError

    df = records.read(csv_path)
    if len(df.columns) == 0:   # an empty file: no run
        import pandas as pd

        return pd.DataFrame(columns=COLUMNS), {}
    if not set(COLUMNS) <= set(df.columns):
        raise Glm5labError(f"{csv_path} is not a benchmark CSV (columns {list(df.columns)[:5]}...)")
    df = df[df.suite == "sparse_mla_kernel"]
    prov = {}
    if len(df):
        df = df[(df.timestamp == df.timestamp.iloc[-1]) & (df.command == df.command.iloc[-1])]
        prov = {k: df[k].iloc[-1] for k in ("gpu", "gpu_uuid", "git_sha", "timestamp")}
    return df, prov


def _measured(val: dict, layout: str, shape: str, qty: str):
    """(value, source) of one quantity of glm5lab's kernel at one shape, from the first of `_SOURCES` the run has
    (x FlashMLA outside the interleaved rounds: FlashMLA's time / ours); (nan, "") when it has none."""
    import math

    for src, metric in _SOURCES[qty]:
        ours = val.get(("glm5lab", layout, shape, metric))
        if ours is None or math.isnan(ours):
            continue
        if qty == "x_fm" and src != "interleaved":
            fm = val.get(("flashmla", layout, shape, metric))
            if fm is None:
                continue
            ours = fm / ours
        return ours, src
    return float("nan"), ""


def _values(df) -> dict:
    df = df[df.implementation.isin(["glm5lab", "flashmla"])]
    return {(r.implementation, r.layout, r.shape, r.metric): float(r.value) for r in df.itertuples()}


def _topk(df) -> str:
    topk = df["shape"].str.extract(r"_K(\d+)")[0].dropna()
    return topk.iloc[-1] if len(topk) else "2048"


def targets_table(csv_path):
    """Issue 7's targets against the LAST run of a kernel benchmark CSV (the suite's or notebook 05's): one row per
    target with the measured value, where it was read from (`_SOURCES`: interleaved rounds first) and whether it is
    met; NaN / None where the run lacks the shape or FlashMLA. The run's provenance (gpu, gpu_uuid, git_sha,
    timestamp) is in the table's attrs, empty when the CSV holds no run; a file that is not a benchmark CSV is a
    Glm5labError."""
    import math

    import pandas as pd

    df, prov = last_run(csv_path)
    val, k = _values(df), _topk(df)
    out = []
    for what, H, T, lay, qty, op, goal in ISSUE_TARGETS:
        measured, source = _measured(val, lay, f"H{H}_T{T}_K{k}", qty)
        met = None if math.isnan(measured) else (measured <= goal if op == "<=" else measured >= goal)
        out.append({"target": what, "heads": H, "tokens": T, "layout": lay, "quantity": qty,
                    "goal": f"{op} {goal:g}", "measured": measured, "met": met, "source": source})
    table = pd.DataFrame(out)
    table.attrs.update(prov)
    return table


HEADLINE_HEADS = (8, 16, 64, 128)
HEADLINE_TOKENS = (1, 8, 32, 128, 512)


def headline_table(csv_path) -> str:
    """The README's kernel table from the LAST run of a kernel benchmark CSV, as markdown: a row per (cache layout,
    heads), a column per token count; each cell glm5lab's time (µs), its ratio to FlashMLA and, from 128 tokens, its
    fraction of the memory roofline -- read as `targets_table` reads them (interleaved rounds first). A cell the run
    lacks reads "n/a". So the numbers a reader sees first are regenerated, not retyped
    (`glm5lab bench --suite full --headline`)."""
    import math

    df, _ = last_run(csv_path)
    val, k = _values(df), _topk(df)
    lines = ["| cache, heads | " + " | ".join(f"{T} token{'s' if T > 1 else ''}" for T in HEADLINE_TOKENS) + " |",
             "|---" * (len(HEADLINE_TOKENS) + 1) + "|"]
    for lay in ("bf16", "fp8_ds_mla"):
        for H in HEADLINE_HEADS:
            cells = []
            for T in HEADLINE_TOKENS:
                shape = f"H{H}_T{T}_K{k}"
                us, x, rf = (_measured(val, lay, shape, q)[0] for q in ("us", "x_fm", "roofline"))
                if math.isnan(us):
                    cells.append("n/a")
                    continue
                cell = f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"
                cell += "" if math.isnan(x) else f", {x:.2f}×"
                cell += f", {rf:.2f}" if T >= 128 and not math.isnan(rf) else ""
                cells.append(cell)
            lines.append(f"| {lay}, {H} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _text(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) or x == "" else str(x)


def _inline() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False
