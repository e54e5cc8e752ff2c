"""PROJECTION (not a measurement): GLM-5 decode throughput on 8x RTX PRO 6000 Blackwell with TP8.

A roofline model: per decode step, every GPU streams its share of the weights the batch touches, the
selected latent KV rows, and the index keys of the whole context, at the card's published memory
bandwidth times an efficiency MEASURED on the H200 (read from the full suite's CSV), then selects the top-k
of the indexer's logits in the time the H200 measured for it (latency-bound: carried over unscaled); two
all-reduces per layer cross PCIe (no NVLink on this card). Every number that is not measured is in `assumptions()` with
its source and kind (published / derived / assumption). Without measured efficiencies the model only
gives the efficiency-1.0 upper bound and lists the missing inputs; it never invents them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from glm5lab.bench import records

DATASHEET = ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet / product page "
             "(nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/), 2025")
SPEC_ARTICLE = "hardware-corner.net, 'RTX 5090 vs RTX Pro 6000 spec comparison', 2025-03-21"
PCIE_SPEC = "PCI-SIG PCIe 5.0 base spec: 32 GT/s per lane, 128b/130b encoding -> 63 GB/s per direction at x16"


@dataclass(frozen=True)
class Card:
    name: str = "RTX PRO 6000 Blackwell"
    mem_bw_gbps: float = 1792.0          # published
    capacity_gb: float = 96.0            # published
    pcie_gbps: float = 63.0              # published (PCIe 5.0 x16, one direction)
    fp8_dense_tflops: float = 1000.0     # derived: 4000 AI TOPS FP4 with 2:4 sparsity / 2 / 2
    gpus: int = 8


@dataclass(frozen=True)
class Knobs:
    """Assumptions that no published number or H200 measurement fixes; change them, see the effect."""
    allreduce_efficiency: float = 0.6    # of the PCIe link, NCCL ring without NVLink (assumption)
    allreduce_step_latency_us: float = 3.0  # per ring step (2*(n-1) steps) (assumption)
    reserved_gb: float = 6.0             # activations, CUDA graphs, allocator slack per GPU (assumption)
    kv_row_bytes: int = 656              # fp8_ds_mla latent row (vLLM's layout)
    index_key_bytes: int = 132           # fp8 index key: 128 values + 4-byte scale (vLLM's layout)
    topk: int = 2048


PROJECTION_LABEL = "PROJECTION for 8x RTX PRO 6000 Blackwell (SM120), TP8: a roofline model, not measured"


def assumptions(card: Card = Card(), knobs: Knobs = Knobs(), measured_on: str = "") -> pd.DataFrame:
    """The projection's inputs and their sources; `measured_on` names the GPU(s) whose suite fed the measured ones
    (`project(...)["measured_on"]`), so the table does not claim an H200 when an H100's tree fed it."""
    suite = f"{measured_on} full suite" if measured_on else "GPU full suite (results/bench/gpu/)"
    rows = [
        ("memory bandwidth per GPU", card.mem_bw_gbps, "GB/s", "published", f"{DATASHEET}; {SPEC_ARTICLE}"),
        ("memory capacity per GPU", card.capacity_gb, "GB", "published", f"{DATASHEET} (GDDR7 ECC)"),
        ("GPUs, tensor parallel", card.gpus, "-", "published", "the original deployment (shared/seeds)"),
        ("interconnect", card.pcie_gbps, "GB/s/direction", "published",
         f"{PCIE_SPEC}; the card has no NVLink ({DATASHEET})"),
        ("FP8 dense tensor throughput", card.fp8_dense_tflops, "TFLOP/s", "derived",
         f"{DATASHEET}: 4000 AI TOPS (FP4, 2:4 sparse) / 2 (dense) / 2 (FP8)"),
        ("all-reduce link efficiency", knobs.allreduce_efficiency, "fraction", "assumption",
         "NCCL ring over PCIe through the host; not measurable on the H200 (NVLink)"),
        ("all-reduce latency per ring step", knobs.allreduce_step_latency_us, "us", "assumption",
         "2*(n-1) steps per all-reduce (~42 us for 8 GPUs): NCCL small-message all-reduce over PCIe is tens of us; issue 11 measures it"),
        ("reserved memory per GPU", knobs.reserved_gb, "GB", "assumption", "activations, graphs, allocator"),
        ("KV row (fp8_ds_mla)", knobs.kv_row_bytes, "B/token/layer", "published",
         "vLLM 0.32 flashmla_sparse layout: 512 fp8 + 4 fp32 scales + 64 bf16"),
        ("index key (fp8)", knobs.index_key_bytes, "B/token/layer", "published",
         "vLLM 0.32 DeepGEMM index-key cache: 128 fp8 + 1 fp32 scale"),
        ("DSA top-k", knobs.topk, "tokens", "published", "GLM-5 config index_topk"),
        ("expert routing", 8, "of 256 experts per token", "assumption",
         "uniform routing: distinct experts per layer = 256*(1-(1-8/256)^B)"),
        ("model sizes", "glm5lab.gguf.inspect.estimate_real_glm5", "-", "derived",
         "GLM-5 config (78 layers, 256 experts), uniform GGUF quantization (notebook 01)"),
        ("indexer top-k time", suite, "us per layer", "assumption",
         f"measured on {measured_on or 'the GPU'} (indexer_bench topk_time, graph-timed where the suite has it, of "
         "the kernel glm5lab's indexer op picks for the batch and context) and carried over unscaled: one program "
         "per row or segment, "
         "bound by latency rather than by memory. On SM120 vLLM 0.32 runs DeepGEMM's indexer kernels instead; "
         "glm5lab's stand in for them (unmeasured there)"),
        ("efficiencies", suite, "fraction of copy bandwidth", "measured",
         "results/bench/gpu/*.csv: attention kernel, indexer kernel, bf16 GEMM weight streaming; from CUDA-graph "
         "time where the suite has it (a captured decode step has no launch overhead), else do_bench time"),
    ]
    return pd.DataFrame(rows, columns=["quantity", "value", "unit", "kind", "source"])


# ------------------------------------------------------------------------------- model sizes
def model_bytes(qtype: str) -> dict:
    """Bytes of GLM-5 by what a decode step does with them (from the GGUF size estimate)."""
    from transformers import GlmMoeDsaConfig

    from glm5lab.gguf.inspect import estimate_real_glm5

    est = estimate_real_glm5((qtype,), nextn_layers=0)
    by = {r.component: (float(r.bytes), float(r.params)) for r in est.itertuples()}
    c = GlmMoeDsaConfig()
    n_moe = c.num_hidden_layers - c.first_k_dense_replace
    routed_params = c.n_routed_experts * 3 * c.hidden_size * c.moe_intermediate_size * n_moe
    moe_bytes, moe_params = by.get("MoE", (0.0, 1.0))
    bpp = moe_bytes / moe_params
    routed = routed_params * bpp
    H, D = c.num_attention_heads, c.hidden_size
    repl = (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim) * D            # q_a, kv_a: replicated in TP
    sharded = (H * (c.qk_nope_head_dim + c.qk_rope_head_dim) * c.q_lora_rank
               + H * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + H * c.v_head_dim * D)
    return {
        "qtype": qtype,
        "total": sum(b for b, _ in by.values()),
        "routed_experts": routed,
        "always_sharded": (moe_bytes - routed) + by.get("dense", (0, 0))[0]
                          + by.get("attention", (0, 0))[0] * sharded / (repl + sharded)
                          + by.get("embedding", (0, 0))[0] / 2,                   # lm_head; lookups are free
        "always_replicated": by.get("attention", (0, 0))[0] * repl / (repl + sharded) + by.get("indexer", (0, 0))[0],
        "active_params": (moe_params - routed_params) + routed_params * c.num_experts_per_tok / c.n_routed_experts
                         + sum(p for k, (_, p) in by.items() if k not in ("MoE", "MTP")),
        "layers": c.num_hidden_layers, "hidden": D, "experts": c.n_routed_experts,
        "experts_per_token": c.num_experts_per_tok,
    }


# ------------------------------------------------------------------- efficiencies from the CSV
def _gpu_rows(frames) -> pd.DataFrame:
    """Rows measured on a GPU (never the CPU profile's interpreter timings)."""
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    df = df[(df.get("gpu", "no GPU").astype(str) != "no GPU")
            & (~df.get("triton_interpret", False).astype(str).isin(["True", "true", "1"]))]
    df = df.assign(value=pd.to_numeric(df.value, errors="coerce"))
    return df


def load_measurements(results_dir: str | Path) -> pd.DataFrame:
    """GPU-measured rows: the full suite's (results/bench/gpu/) first, then the kernel and indexer helpers'
    own runs (results/kernels/, results/indexer/) for anything the suite lacks; of repeated measurements
    of one quantity, only the newest."""
    root = Path(results_dir)
    frames = []
    for prio, sub in enumerate(("bench/gpu", "kernels", "indexer")):
        for p in sorted((root / sub).glob("*.csv")) if (root / sub).exists() else []:
            try:
                frames.append(records.read(p).assign(_prio=prio))
            except Exception:  # noqa: BLE001  (an unreadable file is simply not an input)
                continue
    df = _gpu_rows(frames)
    if df.empty:
        return df
    keys = [k for k in ("suite", "implementation", "shape", "dtype", "layout", "metric") if k in df]
    df = df.sort_values(["_prio", "timestamp"] if "timestamp" in df else ["_prio"],
                        ascending=[True, False] if "timestamp" in df else [True])
    return df.drop_duplicates(keys, keep="first").drop(columns="_prio")


def _nearest(d: pd.DataFrame, key: str, want: float) -> float | None:
    if d.empty:
        return None
    d = d.assign(_k=d[key].astype(float))
    r = d.iloc[(d._k - want).abs().argsort().iloc[0]]
    return float(r.value)


def _graph_timed(d: pd.DataFrame, metric: str) -> pd.DataFrame:
    """`d`'s rows of `metric + "_graph"` (from CUDA-graph time) where it has them, else of `metric` (do_bench time).
    A decode step runs captured in vLLM, without launch overhead; do_bench's time includes it, and at a batch of one
    that is most of it: the Triton attention kernel, 8 heads x 1 token, read 72 us by do_bench and 8.7 us in a graph
    on the H200 (v50), which made the batch-1 projection's attention 8x too slow."""
    graph = d[d.metric == metric + "_graph"]
    return graph if not graph.empty else d[d.metric == metric]


def _nearest_shape(d: pd.DataFrame, batch: int, context: int) -> float:
    """The value of the indexer row (shape B<b>_L<l>_...) nearest this batch and context, relative distance."""
    d = d.assign(B=d["shape"].str.extract(r"B(\d+)_")[0].astype(float),
                 L=d["shape"].str.extract(r"_L(\d+)_")[0].astype(float))
    pref = d[d.dtype == "fp8"] if (d.dtype == "fp8").any() else d
    pref = pref.assign(dist=(pref.B - batch).abs() / max(batch, 1) + (pref.L - context).abs() / max(context, 1))
    return float(pref.sort_values("dist").iloc[0].value)


def topk_time_us(df: pd.DataFrame, batch: int, context: int) -> float | None:
    """Measured time (us) of one layer's indexer top-k for this batch and context, with the kernel glm5lab's indexer
    op runs there (`fastest_topk_method`; CUDA-graph time where the run has it: the "split" kernel is several
    launches), or None when the run has no such rows."""
    from glm5lab.kernels.dsa_indexer import fastest_topk_method

    if df.empty:
        return None
    kernel = f"glm5lab-triton-{fastest_topk_method(context, batch)}"
    d = df[(df.suite == "dsa_indexer") & (df.implementation == kernel)]
    d = _graph_timed(d, "topk_time").dropna(subset=["value"])
    return _nearest_shape(d, batch, context) if not d.empty else None


def efficiencies(df: pd.DataFrame, batch: int, context: int) -> tuple[dict, list[str]]:
    """Measured fractions of the H200's copy bandwidth for this batch/context (CUDA-graph timed where the run has
    it: `_graph_timed`), the indexer top-k's measured time (`topk_us`, us a layer), and what is missing."""
    eff, missing = {}, []
    if df.empty:
        return eff, ["no GPU-measured rows found (run `glm5lab bench --suite full` on a GPU)"]
    att = df[(df.layout == "fp8_ds_mla") & df["shape"].astype(str).str.startswith("H8_")
             & (df.suite == "sparse_mla_kernel")]
    # Blackwell runs the portable Triton kernel: on an H200 "glm5lab" is the Hopper-only Gluon kernel when a
    # "glm5lab-triton" row (the Triton kernel, same run) is there (NOTES.md v7)
    att = att[att.implementation == ("glm5lab-triton" if (att.implementation == "glm5lab-triton").any() else "glm5lab")]
    att = _graph_timed(att, "roofline_fraction")
    if not att.empty:
        att = att.assign(T=att["shape"].str.extract(r"_T(\d+)_")[0])
        eff["attention"] = _nearest(att.dropna(subset=["T"]), "T", batch)
    else:
        missing.append("attention kernel roofline fraction (kernel_bench: glm5lab fp8_ds_mla, 8 heads)")
    # the fp8 index keys' logits as glm5lab's vLLM op runs them: with vLLM's e4m3 q (v58) where the run has those rows
    idx = df[df.implementation == "glm5lab-triton-q8"]
    idx = _graph_timed(idx if not idx.empty else df[df.implementation == "glm5lab-triton"], "fraction_of_copy_ceiling")
    if not idx.empty:
        eff["indexer"] = _nearest_shape(idx, batch, context)
    else:
        missing.append("indexer logits fraction of copy ceiling (indexer_bench)")
    gemm = df[(df.suite == "gemm_streaming") & (df.metric == "fraction_of_copy")]
    if not gemm.empty:
        gemm = gemm.assign(B=gemm["shape"].str.extract(r"B(\d+)")[0])
        eff["weights"] = _nearest(gemm.dropna(subset=["B"]), "B", batch)
    else:
        missing.append("weight-streaming GEMM fraction of copy (gemm_streaming part)")
    topk_us = topk_time_us(df, batch, context)
    if topk_us is not None:
        eff["topk_us"] = topk_us
    else:
        missing.append("indexer top-k time (indexer_bench topk_time of the hist / split kernels)")
    return eff, missing


# ------------------------------------------------------------------------------- the model
def project(qtypes=("Q4_K", "Q8_0"), batches=(1, 8, 32, 64, 128, 256), contexts=(4096, 16384, 65536),
            results_dir: str | Path = "results", card: Card = Card(), knobs: Knobs = Knobs(),
            measurements: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (qtype, batch, context): time per decode step by component (ms), tokens/s, whether it
    fits, and `kind`: 'projection' (measured efficiencies) or 'upper bound (efficiency 1.0)'."""
    df = measurements if measurements is not None else load_measurements(results_dir)
    out = []
    for qt in qtypes:
        mb = model_bytes(qt)
        n, L_layers = card.gpus, mb["layers"]
        for B in batches:
            touched = mb["experts"] * (1 - (1 - mb["experts_per_token"] / mb["experts"]) ** B)
            w_bytes = (mb["always_sharded"] + mb["routed_experts"] * touched / mb["experts"]) / n \
                + mb["always_replicated"]
            for L in contexts:
                kv_bytes = B * min(L, knobs.topk) * knobs.kv_row_bytes * L_layers
                idx_bytes = B * L * knobs.index_key_bytes * L_layers
                logits_bytes = B * L * 4 * L_layers          # what the top-k must read at least
                resident = mb["total"] / n + mb["always_replicated"] * (n - 1) / n \
                    + B * L * (knobs.kv_row_bytes + knobs.index_key_bytes) * L_layers
                fits = resident / 1e9 + knobs.reserved_gb <= card.capacity_gb
                ar_bytes = B * mb["hidden"] * 2
                t_ar = 2 * L_layers * (2 * (n - 1) / n * ar_bytes / (card.pcie_gbps * 1e9 * knobs.allreduce_efficiency)
                                       + 2 * (n - 1) * knobs.allreduce_step_latency_us * 1e-6)
                flops = 2 * mb["active_params"] * B / n
                t_compute = flops / (card.fp8_dense_tflops * 1e12)
                eff, missing = efficiencies(df, B, L)
                for kind in ("upper bound (efficiency 1.0)", "projection"):
                    if kind == "projection" and missing:
                        out.append(dict(qtype=qt, batch=B, context=L, kind=kind, fits=fits,
                                        resident_gb=resident / 1e9, missing_inputs="; ".join(missing)))
                        continue
                    e = eff if kind == "projection" else {"attention": 1.0, "indexer": 1.0, "weights": 1.0}
                    bw = card.mem_bw_gbps * 1e9
                    t_w = w_bytes / (bw * max(e["weights"], 1e-3))
                    t_kv = kv_bytes / (bw * max(e["attention"], 1e-3))
                    t_idx = idx_bytes / (bw * max(e["indexer"], 1e-3))
                    t_topk = (eff["topk_us"] * 1e-6 * L_layers if kind == "projection"
                              else logits_bytes / bw)
                    step = max(t_w + t_kv + t_idx + t_topk, t_compute) + t_ar
                    out.append(dict(qtype=qt, batch=B, context=L, kind=kind, fits=fits, resident_gb=resident / 1e9,
                                    weights_ms=t_w * 1e3, kv_ms=t_kv * 1e3, indexer_ms=t_idx * 1e3,
                                    topk_ms=t_topk * 1e3,
                                    allreduce_ms=t_ar * 1e3, compute_floor_ms=t_compute * 1e3,
                                    step_ms=step * 1e3, tokens_per_s=B / step if fits else float("nan"),
                                    eff_weights=e["weights"], eff_attention=e["attention"],
                                    eff_indexer=e["indexer"], missing_inputs=""))
    res = pd.DataFrame(out)
    res["label"] = PROJECTION_LABEL
    # the GPU(s) whose measured efficiencies fed it (the committed H200 tree, or an H100's, ...)
    res["measured_on"] = ", ".join(sorted(set(df["gpu"].dropna().astype(str)))) if len(df) and "gpu" in df else ""
    return res


def inputs_measured_on(proj: pd.DataFrame) -> str:
    """The GPU(s) whose measured efficiencies fed a projection (`project`'s result); "" when none did."""
    return str(proj["measured_on"].iloc[0]) if "measured_on" in proj and len(proj) else ""


def projection_rows(proj: pd.DataFrame) -> list[dict]:
    """Long-format rows for the CSV (suite 'projection', implementation = kind)."""
    rows = []
    for r in proj.itertuples():
        base = {"suite": "projection", "implementation": r.kind, "shape": f"{r.qtype}_B{r.batch}_L{r.context}",
                "dtype": r.qtype, "layout": "TP8"}
        if isinstance(getattr(r, "missing_inputs", ""), str) and r.missing_inputs:
            rows.append({**base, "metric": "missing_inputs", "value": float("nan"), "unit": r.missing_inputs[:300]})
            continue
        for m, unit in (("step_ms", "ms"), ("tokens_per_s", "tok/s"), ("weights_ms", "ms"), ("kv_ms", "ms"),
                        ("indexer_ms", "ms"), ("topk_ms", "ms"), ("allreduce_ms", "ms"), ("compute_floor_ms", "ms"),
                        ("resident_gb", "GB")):
            rows.append({**base, "metric": m, "value": float(getattr(r, m)), "unit": unit})
    # what the numbers are for, in the CSV itself: its rows' gpu column names the machine that computed them (and
    # measured_on the GPU whose efficiencies fed them), never the GPU the figures describe
    rows.append({"suite": "projection", "implementation": "target", "shape": "-", "dtype": "-", "layout": "TP8",
                 "metric": "projected_for", "value": float("nan"), "unit": PROJECTION_LABEL})
    measured_on = inputs_measured_on(proj)
    if measured_on:   # one row naming the GPU(s) of the measured inputs, for the plots drawn from the CSV
        rows.append({"suite": "projection", "implementation": "inputs", "shape": "-", "dtype": "-", "layout": "TP8",
                     "metric": "measured_on", "value": float("nan"), "unit": measured_on[:300]})
    return rows
