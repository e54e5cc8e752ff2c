"""Tables and the plot notebook 01 shows, computed here so the notebook stays narrative.

Every function returns data (DataFrames / dicts); problems come back as rows, never as exceptions, so a
papermill run shows them instead of failing.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from glm5lab.errors import Glm5labError
from glm5lab.files import save_figure


def roundtrip_table(hf_dir: Path, gguf_paths: dict[str, Path]) -> pd.DataFrame:
    """Per GGUF type: HF -> GGUF -> read back, compared with the HF safetensors (max abs error,
    tensors bit-exact). F32/F16/BF16 are exact after rounding to the type; Q8_0 within about 0.56 d (half a step,
    plus d's own fp16 rounding; d = max|block| / 127). The table reports the errors; tests/test_gguf_writer.py bounds
    them."""
    from glm5lab.gguf.reader import read_hf_tensors
    from glm5lab.gguf.writer import hf_tensor_loaders

    src = {k: f() for k, f in hf_tensor_loaders(hf_dir).items()}
    rows = []
    for qtype, path in gguf_paths.items():
        try:
            back = read_hf_tensors(path)
        except Glm5labError as exc:
            rows.append(dict(qtype=qtype, problem=str(exc)))
            continue
        errs = {k: float(np.abs(back[k] - v).max()) for k, v in src.items() if k in back}
        rows.append(dict(qtype=qtype, tensors=len(back), same_names=set(back) == set(src),
                         bit_exact=sum(e == 0 for e in errs.values()),
                         max_abs_err=max(errs.values()), worst_tensor=max(errs, key=errs.get), problem=""))
    return pd.DataFrame(rows)


def absorption_demo(gguf_path: Path, layer: int = 1, seed: int = 0) -> pd.DataFrame:
    """Why kv_b is split: the score q_nope . k_nope with k_nope = W_kb(latent) equals
    (q_nope @ attn_k_b) . latent, so attention can run over the 512-wide latent cache without ever
    expanding keys; likewise values: (probs @ latent) @ attn_v_b^T. Checked numerically with the file's
    own (dequantized) tensors."""
    from glm5lab.gguf.reader import read_gguf_tensors

    t = read_gguf_tensors(gguf_path, [f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"])
    k_b = t[f"blk.{layer}.attn_k_b.weight"].astype(np.float64)   # [H, kv_lora, nope]
    v_b = t[f"blk.{layer}.attn_v_b.weight"].astype(np.float64)   # [H, v, kv_lora]
    H, r, nope = k_b.shape
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((16, r))                        # 16 cached tokens
    q_nope = rng.standard_normal((H, nope))
    k_nope = np.einsum("hrn,tr->htn", k_b, latent)               # expanded keys [H, T, nope]
    expanded = np.einsum("hn,htn->ht", q_nope, k_nope)
    absorbed = np.einsum("hr,tr->ht", np.einsum("hn,hrn->hr", q_nope, k_b), latent)
    probs = rng.dirichlet(np.ones(16), size=H)                   # [H, T]
    v_expanded = np.einsum("ht,hvr,tr->hv", probs, v_b, latent)
    v_absorbed = np.einsum("hvr,hr->hv", v_b, probs @ latent)
    return pd.DataFrame([
        dict(step="scores q_nope.k_nope", expanded_shape=str(expanded.shape),
             max_abs_diff=float(np.abs(expanded - absorbed).max()),
             cache_floats_per_token_expanded=H * (nope + v_b.shape[1]), cache_floats_per_token_latent=r + 64),
        dict(step="values probs@V", expanded_shape=str(v_expanded.shape),
             max_abs_diff=float(np.abs(v_expanded - v_absorbed).max()),
             cache_floats_per_token_expanded=H * (nope + v_b.shape[1]), cache_floats_per_token_latent=r + 64),
    ])


def shard_demo(src: Path, n_shards: int = 3) -> pd.DataFrame:
    """Split a GGUF, merge it back, compare bytes; then break the set (missing and duplicate shard)
    and record the errors. Runs in a temporary directory that is removed afterwards."""
    from glm5lab.gguf.shards import merge_shards, split_gguf, validate_shard_set

    rows = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        t0 = time.perf_counter()
        parts = split_gguf(src, n_shards, d / src.name, progress=False)
        rows.append(dict(step=f"split into {n_shards}", result=", ".join(p.name for p in parts),
                         seconds=time.perf_counter() - t0))
        t0 = time.perf_counter()
        merged = merge_shards(parts[0], d / "merged.gguf", progress=False)
        same = merged.read_bytes() == Path(src).read_bytes()
        rows.append(dict(step="merge", result=f"byte-identical to the original: {same}",
                         seconds=time.perf_counter() - t0))
        for label, paths in (("duplicate shard", [parts[0], parts[1], parts[1]]),):
            try:
                validate_shard_set(paths)
                rows.append(dict(step=label, result="NOT detected", seconds=0.0))
            except Glm5labError as exc:
                rows.append(dict(step=label, result=f"Glm5labError: {exc}", seconds=0.0))
        parts[-1].unlink()
        try:
            merge_shards(parts[0], d / "merged2.gguf", progress=False)
            rows.append(dict(step="missing shard", result="NOT detected", seconds=0.0))
        except Glm5labError as exc:
            left = (d / "merged2.gguf").exists()
            rows.append(dict(step="missing shard", result=f"Glm5labError: {exc} (output left: {left})",
                             seconds=0.0))
    return pd.DataFrame(rows)


def plot_bytes(tables: dict[str, pd.DataFrame], png_path: Path, caption: str) -> Path:
    """One stacked bar panel per model: bytes by component, stacked by GGML type. Saved as PNG."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.5), squeeze=False)
    for ax, (label, t) in zip(axes[0], tables.items()):
        unit, div = ("GB", 1e9) if t["bytes"].sum() > 1e9 else ("MB", 1e6)
        pivot = t.pivot_table(index="component", columns="ggml_type", values="bytes", aggfunc="sum",
                              fill_value=0) / div
        order = [c for c in ["embedding", "attention", "indexer", "dense", "MoE", "MTP"] if c in pivot.index]
        pivot = pivot.loc[order]
        pivot.plot.bar(stacked=True, ax=ax, rot=0)
        for i, total in enumerate(pivot.sum(axis=1)):  # small components are invisible next to MoE
            ax.annotate(f"{total:,.2f}", (i, total), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{label}\n(total {t['bytes'].sum() / div:,.1f} {unit})", fontsize=10)
        ax.legend(title="GGML type", fontsize=8)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    try:
        return save_figure(fig, png_path)
    finally:
        plt.close(fig)


def skeleton_inspection(qtype: str = "Q4_K") -> dict:
    """Write a sparse real-GLM-5-geometry GGUF (metadata and tensor table only), inspect it and time
    it, then delete it: shows the inspector reads headers only, on a file of the real size."""
    import resource

    from transformers import GlmMoeDsaConfig

    from glm5lab.gguf.inspect import inspect_gguf
    from glm5lab.gguf.writer import write_skeleton_gguf

    with tempfile.TemporaryDirectory() as d:
        path = write_skeleton_gguf(GlmMoeDsaConfig(), Path(d) / "glm5-skeleton.gguf", qtype, nextn_layers=1)
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        r = inspect_gguf(path)
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        return dict(report=r, apparent_file_GB=path.stat().st_size / 1e9,
                    on_disk_MB=path.stat().st_blocks * 512 / 1e6, inspect_seconds=seconds,
                    page_faults=(after.ru_minflt - before.ru_minflt) + (after.ru_majflt - before.ru_majflt))
