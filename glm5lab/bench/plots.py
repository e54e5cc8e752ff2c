"""Plots drawn FROM the bench CSVs (never the other way round), each titled with its provenance.

CPU-profile plots say in the title that their timings are not performance; projection plots mark every
projected value as PROJECTED (dashed lines, hatched label) and draw the efficiency-1.0 upper bound apart.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from glm5lab.bench import records
from glm5lab.files import save_figure


def _num(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(value=pd.to_numeric(df["value"], errors="coerce"))


def provenance_line(df: pd.DataFrame, profile: str) -> str:
    if df is None or df.empty:
        return f"profile {profile}"
    r = df.iloc[-1]
    gpu = r.get("gpu", "?")
    bits = [f"{gpu}", f"torch {r.get('torch', '?')}", f"triton {r.get('triton', '?')}",
            f"git {r.get('git_sha', '?')}", str(r.get("timestamp", ""))[:19]]
    line = ", ".join(str(b) for b in bits)
    if profile == "cpu" or str(gpu) == "no GPU":
        line += "  |  CPU interpreter: timings are NOT performance"
    return line


def save_tight(fig, out: Path) -> Path:
    """The suite's plots: whole files (glm5lab.files.save_figure), cropped to what is drawn."""
    return save_figure(fig, out, bbox_inches="tight")


def plot_kernel_accuracy(df: pd.DataFrame, profile: str):
    d = _num(df[df.metric == "rel_err_out"])
    if d.empty:
        return None
    g = d.groupby(["implementation", "layout"]).value.max().sort_values()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(g) + 1.5))
    labels = [f"{i} [{l}]" for i, l in g.index]
    colors = ["tab:gray" if i.endswith("-storage") else "tab:blue" for i, _ in g.index]
    ax.barh(labels, g.values.clip(min=1e-12), color=colors)
    ax.set_xscale("log")
    ax.set_xlabel("relative error of out vs float64 reference (worst over head counts)")
    ax.set_title("Sparse-MLA accuracy: kernels (blue) vs cache storage/quantization (gray)\n"
                 + provenance_line(df, profile), fontsize=9)
    return fig


def plot_model_accuracy(df: pd.DataFrame, profile: str):
    d = _num(df[df.metric == "logits_max_abs_err_at_position"])
    if d.empty:
        return None
    d = d.assign(pos=d["shape"].str.extract(r"_pos(\d+)$")[0].astype(float))
    fig, ax = plt.subplots(figsize=(8, 4))
    for (impl, lay, dt), g in d.groupby(["implementation", "layout", "dtype"]):
        ax.plot(g.pos, g.value.clip(lower=1e-9), marker="o", ms=2, lw=1, label=f"{impl} [{lay} GGUF, KV {dt}]")
    flips = _num(df[df.metric == "topk_flip_at_position"])
    if not flips.empty:
        fpos = flips["shape"].str.extract(r"_pos(\d+)$")[0].astype(float)
        ax.scatter(fpos, flips.value.clip(lower=1e-9), marker="x", s=60, color="black", zorder=5,
                   label="DSA top-k differs from transformers' (near-tie)")
    ax.set_yscale("log")
    ax.set_xlabel("position (DSA top-k selects a strict subset beyond the top-k size)")
    ax.set_ylabel("max |logits - transformers| (same GGUF weights)")
    ax.legend(fontsize=7)
    ax.set_title("Tiny GLM-5: glm5lab decode path vs transformers GlmMoeDsaForCausalLM\n"
                 + provenance_line(df, profile), fontsize=9)
    return fig


def plot_attention_stack(df: pd.DataFrame, profile: str):
    d = _num(df[df.metric == "stack78_tokens_per_s"])
    if d.empty:
        return None
    parts = d["shape"].str.extract(r"H(\d+)_B(\d+)_L(\d+)").astype(float)
    d = d.assign(H=parts[0], B=parts[1], L=parts[2])
    heads = sorted(d.H.dropna().unique())
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, H in zip(axes[0], heads):
        for (impl, L), g in d[d.H == H].groupby(["implementation", "L"]):
            g = g.sort_values("B")
            ax.plot(g.B, g.value, marker="o", label=f"{impl}, context {int(L)}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s of a 78-layer attention stack (measured)")
        ax.set_title(f"{int(H)} heads per GPU", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("GLM-5-shaped attention decode step (random weights)\n" + provenance_line(df, profile), fontsize=9)
    return fig


def plot_projection(df: pd.DataFrame, profile: str):
    d = _num(df[df.metric == "tokens_per_s"])
    if d.empty:
        return None
    parts = d["shape"].str.extract(r"(\w+?)_B(\d+)_L(\d+)")
    d = d.assign(qtype=parts[0], B=parts[1].astype(float), L=parts[2].astype(float))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (kind, qt, L), g in d.groupby(["implementation", "qtype", "L"]):
        g = g.sort_values("B").dropna(subset=["value"])
        if g.empty:
            continue
        style = "--" if kind == "projection" else ":"
        tag = "PROJECTED" if kind == "projection" else "upper bound (eff. 1.0)"
        ax.plot(g.B, g.value, style, marker="o", ms=3, label=f"{tag}: {qt}, context {int(L)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (concurrent decode streams)")
    ax.set_ylabel("decode tokens/s (PROJECTED)")
    ax.text(0.02, 0.96, "PROJECTION, not a measurement", transform=ax.transAxes, fontsize=10,
            color="darkred", va="top", bbox=dict(facecolor="white", edgecolor="darkred", alpha=0.9))
    ax.legend(fontsize=6, loc="lower right")
    missing = df[df.metric == "missing_inputs"]
    note = "" if missing.empty else "\nmeasured efficiencies missing: only the efficiency-1.0 upper bound is drawn"
    source = df.loc[df.metric == "measured_on", "unit"]
    fed = f"{source.iloc[-1]} efficiencies" if len(source) else "measured efficiencies"
    ax.set_title(f"GLM-5 on 8x RTX PRO 6000 Blackwell, TP8 (roofline model fed by {fed})\n"
                 + provenance_line(df, profile) + note, fontsize=8)
    return fig


def plot_projection_breakdown(df: pd.DataFrame, profile: str, context: int = 16384):
    d = _num(df[df.metric.isin(["weights_ms", "kv_ms", "indexer_ms", "topk_ms", "allreduce_ms"])])
    if d.empty:
        return None
    parts = d["shape"].str.extract(r"(\w+?)_B(\d+)_L(\d+)")
    d = d.assign(qtype=parts[0], B=parts[1].astype(int), L=parts[2].astype(int))
    kind = "projection" if (d.implementation == "projection").any() else "upper bound (efficiency 1.0)"
    d = d[(d.implementation == kind) & (d.L == context)]
    if d.empty:
        return None
    qt = sorted(d.qtype.unique())[0]
    p = d[d.qtype == qt].pivot_table(index="B", columns="metric", values="value")
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = None
    for m in ["weights_ms", "kv_ms", "indexer_ms", "topk_ms", "allreduce_ms"]:
        if m in p:
            ax.bar([str(b) for b in p.index], p[m], bottom=bottom, label=m.replace("_ms", ""),
                   hatch="//" if kind == "projection" else None, alpha=0.85)
            bottom = p[m] if bottom is None else bottom + p[m]
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per decode step (PROJECTED)")
    ax.legend(fontsize=8)
    ax.set_title(f"GLM-5 on 8x RTX PRO 6000 Blackwell, TP8: where the time goes ({kind}, {qt}, context {context}) "
                 f"- PROJECTED\n" + provenance_line(df, profile), fontsize=8)
    return fig


def draw_all(bench_dir: str | Path, profile: str) -> list[Path]:
    """Every plot whose CSV exists in bench_dir (latest run of each); PNGs under bench_dir/plots/."""
    from glm5lab.bench.suites import latest_run

    bench_dir = Path(bench_dir)
    made = []
    jobs = [("kernel_accuracy", plot_kernel_accuracy), ("model_accuracy", plot_model_accuracy),
            ("attention_stack", plot_attention_stack), ("projection", plot_projection),
            ("projection", plot_projection_breakdown)]
    for part, fn in jobs:
        p = bench_dir / f"{part}.csv"
        if not p.exists():
            continue
        df = latest_run(records.read(p))
        fig = fn(df, profile)
        if fig is None:
            continue
        made.append(save_tight(fig, bench_dir / "plots" / f"{fn.__name__.replace('plot_', '')}.png"))
        plt.close(fig)
    return made
