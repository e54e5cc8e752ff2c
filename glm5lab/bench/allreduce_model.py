"""MODEL (paper projection, not a measurement): the all-reduce cost of one GLM-5 decode step under TP.

Why: with tensor parallelism every GPU holds 1/N of the attention heads (and of the MoE/dense MLP
widths), so each layer ends its attention block and its MoE block with an all-reduce of the hidden
state: 2 all-reduces x 78 layers per decode step, each of batch x 6144 bf16 values. Whether that
traffic matters depends on the link: NVLink on an H200 HGX board, or PCIe Gen5 on 8x RTX PRO 6000
Blackwell (the original deployment; that card has no NVLink). This module puts numbers on it from
published link rates and the textbook ring all-reduce:

    t(bytes, N) = 2 (N-1)/N * bytes / (line rate * efficiency)  +  2 (N-1) * alpha

(2(N-1) ring steps, each moving bytes/N and paying a per-step latency alpha). NCCL with NVLink
multicast (NVLS / NVLink SHARP) off, which is how the device machines run, uses ring/tree
algorithms, so the ring model is the right first-order picture; tree at tiny messages is faster in
latency, which alpha absorbs.

Every number that is not published is an assumption in `assumptions()`; the tables and the plot carry
the label MODEL. Measured values (scripts/tp_attention_stack.py -> results/tp/*.csv) are read by
`measured_vs_model` and shown apart: never mixed into the model's columns.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from glm5lab.bench import records
from glm5lab.files import save_figure, write_table

MODEL_LABEL = "MODEL (paper projection, not measured)"
GLM5_HIDDEN = 6144
GLM5_LAYERS = 78
ALLREDUCES_PER_LAYER = 2          # after attention o_proj and after the MoE / dense MLP block
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TP_SUITE = "tp_attention_stack"   # glm5lab.bench.tensor_parallel.SUITE (not imported: that module needs torch)

H200_PAGE = "NVIDIA H200 Tensor Core GPU product page / datasheet (nvidia.com/en-us/data-center/h200/), 2024"
NCCL_212 = ("NCCL maintainer (S. Jeaugey) in github.com/NVIDIA/nccl-tests/issues/212, 2024-05: NVLink4 line "
            "rate 450 GB/s, ~370 GB/s effective ring busBw after protocol overhead")
NCCL_1259 = ("github.com/NVIDIA/nccl/issues/1259, 2024-04: small all-reduces on HGX H100 take a few us "
             "(~6 us on 2 GPUs, NVLS); order of magnitude for alpha")


@dataclass(frozen=True)
class Link:
    """One interconnect: per-direction line rate per GPU, achievable fraction, per-ring-step latency."""
    name: str
    line_gbps: float
    efficiency: float
    step_latency_us: float
    rate_source: str
    efficiency_source: str
    latency_source: str

    @property
    def bus_gbps(self) -> float:
        return self.line_gbps * self.efficiency


def _pcie_link() -> Link:
    # The PCIe figures come from the notebook-06 projection so both models use the same assumptions.
    from glm5lab.bench.projection import DATASHEET, PCIE_SPEC, Card, Knobs

    card, knobs = Card(), Knobs()
    return Link("PCIe Gen5 x16 (8x RTX PRO 6000 Blackwell, no NVLink)", card.pcie_gbps,
                knobs.allreduce_efficiency, knobs.allreduce_step_latency_us,
                f"published: {PCIE_SPEC}; the card has no NVLink ({DATASHEET})",
                "assumption (glm5lab.bench.projection.Knobs): NCCL ring through the host PCIe switches",
                "assumption (glm5lab.bench.projection.Knobs)")


def links() -> dict[str, Link]:
    return {
        "nvlink_h200": Link("NVLink 4 (H200 HGX, NVSwitch)", 450.0, 370.0 / 450.0, 0.5,
                            f"published: 900 GB/s NVLink per GPU, i.e. 450 GB/s per direction ({H200_PAGE})",
                            f"derived: 370/450 ({NCCL_212})",
                            f"assumption: 0.5 us per ring step, 7 us per 8-GPU all-reduce ({NCCL_1259})"),
        "pcie5_rtxpro6000": _pcie_link(),
    }


def allreduce_time_us(nbytes: float, gpus: int, link: Link) -> tuple[float, float]:
    """(bandwidth term, latency term) of one ring all-reduce, in microseconds. 0 for one GPU."""
    if gpus <= 1:
        return 0.0, 0.0
    bw = 2 * (gpus - 1) / gpus * nbytes / (link.bus_gbps * 1e9) * 1e6
    return bw, 2 * (gpus - 1) * link.step_latency_us


def decode_step_allreduce(batches=BATCHES, gpus=(4, 8), link_names=None, hidden: int = GLM5_HIDDEN,
                          layers: int = GLM5_LAYERS, per_layer: int = ALLREDUCES_PER_LAYER,
                          bytes_per_value: int = 2) -> pd.DataFrame:
    """One row per (link, gpus, batch): bytes per all-reduce, time per call and per decode step."""
    ls = links()
    rows = []
    for key in link_names or ls:
        link = ls[key]
        for n in gpus:
            for b in batches:
                nbytes = b * hidden * bytes_per_value
                t_bw, t_lat = allreduce_time_us(nbytes, n, link)
                calls = per_layer * layers
                rows.append(dict(kind=MODEL_LABEL, link=key, link_name=link.name, gpus=n, batch=b,
                                 bytes_per_token=hidden * bytes_per_value, bytes_per_allreduce=nbytes,
                                 allreduces_per_step=calls, per_call_us=t_bw + t_lat,
                                 per_call_bandwidth_us=t_bw, per_call_latency_us=t_lat,
                                 per_step_ms=calls * (t_bw + t_lat) / 1e3,
                                 bus_gbps=link.bus_gbps))
    return pd.DataFrame(rows)


def assumptions() -> pd.DataFrame:
    rows = [("hidden size", GLM5_HIDDEN, "values/token", "published", "GLM-5 config.json (hidden_size)"),
            ("layers", GLM5_LAYERS, "-", "published", "GLM-5 config.json (num_hidden_layers)"),
            ("all-reduces per layer", ALLREDUCES_PER_LAYER, "-", "derived",
             "Megatron-style TP: one after attention o_proj (row-parallel), one after the MoE/MLP block"),
            ("all-reduce dtype", 2, "bytes/value", "assumption", "bf16 activations (vLLM default for GLM-5)"),
            ("algorithm", "ring", "-", "assumption",
             "NVLink multicast (NVLS) off on the device machines; NCCL ring/tree, modeled as ring")]
    for key, link in links().items():
        rows += [(f"{key}: line rate per direction", link.line_gbps, "GB/s", "published", link.rate_source),
                 (f"{key}: efficiency", round(link.efficiency, 3), "fraction", "derived" if link.efficiency_source.startswith("derived") else "assumption",
                  link.efficiency_source),
                 (f"{key}: latency per ring step", link.step_latency_us, "us", "assumption", link.latency_source)]
    return pd.DataFrame(rows, columns=["quantity", "value", "unit", "kind", "source"])


def plot(df: pd.DataFrame, path: str | os.PathLike | None = None, measured: pd.DataFrame | None = None):
    """Per-decode-step all-reduce time vs batch: model as lines (labeled MODEL), measured as markers."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (key, n), d in df.groupby(["link", "gpus"]):
        ax.plot(d.batch, d.per_step_ms, "--" if "pcie" in key else "-",
                label=f"MODEL {d.link_name.iloc[0]}, TP{n}")
    if measured is not None and not measured.empty:
        for (lay, impl), d in measured.groupby(["layout", "implementation"]):
            ax.plot(d.batch, d.per_step_ms, "o", ms=7, label=f"MEASURED {lay} ({impl})")
    else:
        ax.text(0.02, 0.02, "no measured multi-GPU rows (results/tp/): model only", transform=ax.transAxes,
                fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (decode tokens per step)")
    ax.set_ylabel(f"all-reduce time per decode step, ms ({ALLREDUCES_PER_LAYER} x {GLM5_LAYERS} calls)")
    ax.set_title(f"GLM-5 TP decode all-reduce cost: {MODEL_LABEL}\n"
                 f"ring: 2(N-1)/N * B*{GLM5_HIDDEN}*2 bytes / bus bw + 2(N-1)*alpha", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path, dpi=120)
    return fig


def write_results(out_dir: str | os.PathLike = "results/tp") -> dict[str, Path]:
    """results/tp/allreduce_model.csv (+ _assumptions.csv) and allreduce_model.png, all labeled MODEL."""
    out = Path(out_dir)
    df = decode_step_allreduce(gpus=(2, 4, 8))
    paths = {"csv": out / "allreduce_model.csv", "assumptions": out / "allreduce_model_assumptions.csv",
             "png": out / "allreduce_model.png"}
    from glm5lab.bench.records import provenance

    made_by = provenance("glm5lab.bench.allreduce_model.write_results: a MODEL, not measured")
    write_table(df.assign(**made_by), paths["csv"])
    write_table(assumptions().assign(**made_by), paths["assumptions"])
    fig = plot(df[df.gpus.isin([4, 8])], None)
    from glm5lab.env import collect

    info = collect()
    fig.text(0.01, 0.005, f"glm5lab {info.get('glm5lab')}, git {info.get('git_sha')}, {info.get('timestamp')}; "
             f"inputs: {paths['assumptions'].name}", fontsize=6, color="gray")
    save_figure(fig, paths["png"], dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return paths


# ------------------------------------------------------------------ measured (results/tp) vs model
def load_measured(results_dir: str | os.PathLike = "results") -> pd.DataFrame:
    """All-reduce rows measured by scripts/tp_attention_stack.py (results/tp/tp_attention_stack*.csv) on
    GPUs with world size > 1: one row per (layout, implementation, batch, context), per-call and per-step
    (x 2 x 78 calls) all-reduce time, all-reduce share of the layer step. Empty when nothing was measured."""
    df = _read_tp_rows(results_dir)
    if df.empty:
        return pd.DataFrame()
    df = df[df.world > 1]
    if df.empty:
        return pd.DataFrame()
    wide = df.pivot_table(index=["layout", "implementation", "batch", "context"], columns="metric",
                          values="value", aggfunc="last").reset_index()
    keep = {"allreduce_isolated_time": "per_call_us", "allreduce_time": "in_step_per_layer_us",
            "allreduce_share": "allreduce_share", "step_time": "layer_step_us"}
    wide = wide.rename(columns={k: v for k, v in keep.items() if k in wide})
    if "per_call_us" in wide:
        wide["per_step_ms"] = wide.per_call_us * ALLREDUCES_PER_LAYER * GLM5_LAYERS / 1e3
    wide.insert(0, "kind", "MEASURED")
    return wide


def _read_tp_rows(results_dir) -> pd.DataFrame:
    """GPU rows of the TP suite with batch/context/tp/world parsed out of shape and layout."""
    frames = []
    for p in sorted((Path(results_dir) / "tp").glob("tp_attention_stack*.csv")):
        try:
            frames.append(records.read(p))
        except Exception:  # noqa: BLE001  (an unreadable file is not an input)
            continue
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    df = df[(df.suite == TP_SUITE) & (df.gpu.astype(str) != "no GPU")]
    if df.empty:
        return df
    return df.assign(value=pd.to_numeric(df.value, errors="coerce"),
                     batch=df["shape"].str.extract(r"_B(\d+)_")[0].astype(float),
                     context=df["shape"].str.extract(r"_L(\d+)")[0].astype(float),
                     tp=df.layout.astype(str).str.extract(r":tp(\d+)")[0].astype(float),
                     world=df.layout.astype(str).str.extract(r":world(\d+)")[0].astype(float))


def slice_projection(results_dir: str | os.PathLike = "results", link: str = "nvlink_h200") -> pd.DataFrame:
    """PROJECTION from what one GPU measures: the compute of ONE TP slice (world 1, tp N: step time less
    its 1-rank all-reduces, MEASURED) + the modeled N-GPU all-reduces of the layer (MODEL), against the
    MEASURED 1-GPU all-heads step of the same shapes. Empty when no such GPU rows exist."""
    df = _read_tp_rows(results_dir)
    if df.empty:
        return pd.DataFrame()
    sl = df[(df.world == 1) & (df.tp > 1) & (df.metric == "compute_time")]
    one = df[(df.world == 1) & (df.tp == 1) & (df.metric == "step_time")]
    rows = []
    lk = links()[link]
    for r in sl.itertuples():
        n = int(r.tp)
        base = one[(one.batch == r.batch) & (one.context == r.context) & (one.implementation == r.implementation)]
        t_bw, t_lat = allreduce_time_us(r.batch * GLM5_HIDDEN * 2, n, lk)
        ar = ALLREDUCES_PER_LAYER * (t_bw + t_lat)
        step = r.value + ar
        one_step = float(base.value.iloc[-1]) if not base.empty else float("nan")
        rows.append(dict(kind=f"PROJECTION: measured TP{n}-slice compute + {MODEL_LABEL} all-reduce ({link})",
                         implementation=r.implementation, machine=str(r.layout).split(":")[0], tp=n,
                         batch=int(r.batch), context=int(r.context), measured_slice_compute_us=r.value,
                         modeled_allreduce_us=ar, projected_tp_step_us=step,
                         projected_allreduce_share=ar / step, measured_1gpu_step_us=one_step,
                         projected_speedup_vs_1gpu=one_step / step,
                         projected_stack78_tokens_per_s=r.batch / (GLM5_LAYERS * step * 1e-6)))
    return pd.DataFrame(rows).drop_duplicates(subset=["implementation", "machine", "tp", "batch", "context"],
                                              keep="last").reset_index(drop=True) if rows else pd.DataFrame()


@dataclass
class TPCommunication:
    """What notebook 06 shows about TP communication; the three tables are kept apart on purpose."""
    model: pd.DataFrame               # MODEL: ring all-reduce on paper, per link / GPUs / batch
    measured: pd.DataFrame            # MEASURED: multi-GPU runs of scripts/tp_attention_stack.py (world > 1)
    slice_projection: pd.DataFrame    # PROJECTION: measured 1-GPU TP slice + modeled all-reduce
    assumptions: pd.DataFrame
    fig: object


def measured_vs_model(results_dir: str | os.PathLike = "results", gpus=(4, 8), save: bool = True) -> TPCommunication:
    """Notebook 06's view of TP communication: model, measured and slice-projection tables, apart, and a
    figure with model lines and measured markers. Never raises for missing or unreadable measurements:
    the tables are then empty (or hold an `error` column) and the plot says so."""
    model = decode_step_allreduce(gpus=gpus)
    tables = {}
    for name, fn in (("measured", load_measured), ("slice_projection", slice_projection)):
        try:
            tables[name] = fn(results_dir)
        except Exception as exc:  # noqa: BLE001  (a notebook cell must not raise)
            tables[name] = pd.DataFrame({"error": [f"{type(exc).__name__}: {exc}"]})
    measured = tables["measured"]
    ok = measured if ("per_step_ms" in measured and "batch" in measured) else None
    path = Path(results_dir) / "tp" / "allreduce_measured_vs_model.png" if save else None
    fig = plot(model, path, measured=ok)
    return TPCommunication(model, measured, tables["slice_projection"], assumptions(), fig)


if __name__ == "__main__":      # python -m glm5lab.bench.allreduce_model [OUT_DIR]
    import sys

    for kind, p in write_results(sys.argv[1] if len(sys.argv) > 1 else "results/tp").items():
        print(f"{kind:12s} {p}")
