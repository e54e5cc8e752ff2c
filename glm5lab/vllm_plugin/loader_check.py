"""Check a GLM-5 GGUF against the real loading code: the plugin's iterator + glm5lab's adapter, then vLLM.

Two levels, both on the installed code:
* `adapter_report`: every tensor the adapter hands vLLM, in HF names, compared with the HF checkpoint
  (exact for float types up to the file's rounding; Q8_0 within its block bound).
* `vllm_load_report`: vLLM 0.32's own `GlmMoeDsaForCausalLM` (its generic DSA model, which vLLM builds on CPU, and
  on CUDA where glm5lab's `dsa_model` routes GLM-5 to it; vLLM's CUDA DSA model has a `load_weights` of its own,
  which this check does not run), built on CPU by vLLM's config machinery and
  the plugin's GGUF loader, fed through its real `load_weights`; reports parameters never written and
  names vLLM refused, and compares every unquantized parameter with what the HF checkpoint implies.
  vLLM's CPU platform refuses sparse attention at model construction ("Sparse Attention is not supported
  on CPU"), so this check builds the attention layers with a weights-only stand-in backend (it holds no
  weights and is never run); everything else is vLLM's.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from glm5lab.errors import Glm5labError, first_line
from glm5lab.files import save_figure

# ------------------------------------------------------------------ tolerances

F16_REL = 2.0 ** -11      # round-to-nearest fp16: |x - fp16(x)| <= |x| * 2^-11 (normal range)
BF16_REL = 2.0 ** -8
Q8_0_FACTOR = 0.5 + 127 * 2.0 ** -11  # |err| <= d/2 (rounding) + 127*|d - fp16(d)|, d = block amax / 127


def q8_0_bound(arr: np.ndarray) -> np.ndarray:
    """Per-element bound of Q8_0's error for an array quantized in blocks of 32 along its last axis."""
    a = np.abs(np.asarray(arr, dtype=np.float64))
    blocks = a.reshape(*a.shape[:-1], a.shape[-1] // 32, 32)
    d = blocks.max(axis=-1, keepdims=True) / 127.0
    return np.broadcast_to(d * Q8_0_FACTOR, blocks.shape).reshape(a.shape) + 1e-12


def error_bound(hf: np.ndarray, ggml_type: str, layout: str = "plain", heads: int | None = None,
                nope: int | None = None) -> np.ndarray:
    """Per-element tolerance for an HF tensor that went through a GGUF of `ggml_type`.

    layout "kv_b": the tensor was stored as attn_k_b/attn_v_b (blocks along other axes): bound computed in
    the GGUF layout and joined back."""
    hf = np.asarray(hf, dtype=np.float64)
    if ggml_type == "F32":
        return np.full(hf.shape, 1e-12)
    if ggml_type == "F16":
        return np.abs(hf) * F16_REL + 6e-8  # 6e-8: fp16's subnormal spacing
    if ggml_type == "BF16":
        return np.abs(hf) * BF16_REL + 1e-30
    if ggml_type == "Q8_0":
        if layout == "kv_b":
            from glm5lab.gguf import names as N

            v = hf.shape[0] // heads - nope
            k_b, v_b = N.split_kv_b(hf, heads, nope, v)
            return N.join_kv_b(q8_0_bound(k_b), q8_0_bound(v_b))
        return q8_0_bound(hf)
    raise Glm5labError(f"no error bound known for GGML type {ggml_type}")


# ------------------------------------------------------------------ adapter level

def model_config_for(gguf_path, hf_dir=None):
    """The HF config vLLM would use: config.json from hf_dir, else built from the GGUF metadata."""
    if hf_dir is not None:
        from glm5lab.model.checkpoint import read_hf_config

        return read_hf_config(hf_dir)
    from glm5lab.vllm_plugin.gguf_loader import config_from_gguf

    return config_from_gguf(gguf_path)


def adapter_weights(gguf_path, hf_config):
    """Run the plugin's reader + glm5lab's adapter: (list of (name, tensor), adapter, load spec)."""
    from glm5lab.vllm_plugin.gguf_loader import adapter_class

    adapter = adapter_class()(hf_config)
    mc = types.SimpleNamespace(hf_config=hf_config, trust_remote_code=False)
    spec = adapter.prepare_loading(str(gguf_path), mc)
    return list(adapter.prepare_weights(mc)), adapter, spec


def adapter_names_report(gguf_path) -> dict:
    """Without an HF checkpoint: the adapter's name map over every tensor (a tensor with no GLM-5 name is a
    Glm5labError, as when vLLM loads the file), and the file's tensors against the names and shapes its own
    metadata implies. Reads no tensor data, so it suits a file too large to load here."""
    from glm5lab.gguf.reader import open_gguf
    from glm5lab.gguf.shards import geometry_mismatches
    from glm5lab.vllm_plugin.gguf_loader import adapter_class

    s = open_gguf(gguf_path)
    hf_config = model_config_for(gguf_path)
    adapter = adapter_class()(hf_config)
    spec = adapter.prepare_loading(str(gguf_path), types.SimpleNamespace(hf_config=hf_config, trust_remote_code=False))
    m = geometry_mismatches(s)
    return {"tensors": len(s.tensor_index), "mapped": len(spec.gguf_to_hf_name_map),
            "skipped": dict(adapter.skipped), "missing": m.missing,
            "wrong_shape": {name: f"{found} (metadata implies {implied})"
                            for name, (found, implied) in m.wrong.items()},
            "beyond_blocks": m.beyond_blocks}


def _hf_checkpoint(hf_dir) -> dict:
    from glm5lab.model.checkpoint import load_safetensors, safetensors_files

    out = {}
    for f in safetensors_files(hf_dir):
        out.update(load_safetensors(f))
    return out


def adapter_report(gguf_path, hf_dir):
    """DataFrame, one row per HF tensor: what the adapter produced vs the HF checkpoint, with the bound."""
    import pandas as pd
    import gguf as ggufmod
    import torch

    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(gguf_path)  # validates first: a bad file is a one-line error naming it, not a plugin traceback
    hf_config = model_config_for(gguf_path, hf_dir)
    weights, adapter, spec = adapter_weights(gguf_path, hf_config)
    reference = _hf_checkpoint(hf_dir)
    inv = {hf: g for g, hf in spec.gguf_to_hf_name_map.items()}

    def source_type(hf_name: str) -> str:
        key = hf_name
        if ".experts." in key:
            parts = key.split(".")
            parts[parts.index("experts") + 1] = "0"
            key = ".".join(parts)
        if key.endswith("kv_b_proj.weight"):
            key = key.replace("kv_b_proj", "k_b_proj")
        g = inv.get(key)
        return s.tensor(g).tensor_type.name if g is not None else "?"

    types_by_base = {}
    values = {}
    for name, t in weights:
        if name.endswith(".qweight_type"):
            types_by_base[name[: -len(".qweight_type")]] = int(t)
        elif name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            if ".experts." in base and base not in types_by_base:  # plugin sends the type for expert 0 only
                parts = base.split(".")
                parts[parts.index("experts") + 1] = "0"
                types_by_base[base] = types_by_base[".".join(parts)]
            qt = ggufmod.GGMLQuantizationType(types_by_base[base])
            values[base + ".weight"] = ggufmod.quants.dequantize(t.numpy(), qt)
        else:
            values[name] = t.to(torch.float32).numpy() if t.dtype != torch.float32 else t.numpy()

    rows = []
    for name in sorted(set(values) | set(reference)):
        got, ref = values.get(name), reference.get(name)
        row = {"hf_name": name, "gguf_type": source_type(name) if got is not None else None,
               "delivered": got is not None, "in_checkpoint": ref is not None}
        if got is not None and ref is not None:
            ref64 = ref.astype(np.float64)
            if got.shape != ref.shape:
                row.update(shape_ok=False, max_abs_err=np.inf, max_err_over_bound=np.inf)
            else:
                layout = "kv_b" if name.endswith("kv_b_proj.weight") else "plain"
                bound = error_bound(ref64, row["gguf_type"], layout, hf_config.num_attention_heads,
                                    hf_config.qk_nope_head_dim)
                err = np.abs(got.astype(np.float64) - ref64)
                row.update(shape_ok=True, max_abs_err=float(err.max()),
                           max_err_over_bound=float((err / bound).max()))
        rows.append(row)
    df = pd.DataFrame(rows)
    df["ok"] = df["delivered"] & df["in_checkpoint"] & df.get("shape_ok", False).fillna(False).astype(bool) \
        & (df["max_err_over_bound"].fillna(np.inf) <= 1.0)
    return df


# ------------------------------------------------------------------ vLLM level

class _WeightsOnlyImpl:
    """Stands in for a sparse MLA attention impl on CPU: holds nothing, does nothing, is never run."""

    is_sparse = True
    supports_dense_mha_prefill = False
    supports_quant_query_input = False
    dcp_world_size = 1

    def __init__(self, *args, **kwargs):
        pass

    def process_weights_after_loading(self, act_dtype):
        pass


@contextlib.contextmanager
def weights_only_sparse_backend():
    """Within the block, vLLM's CPU platform hands sparse MLA layers a weights-only backend instead of
    raising "Sparse Attention is not supported on CPU". Restored on exit; not a ledger patch because it
    never runs inside vLLM's own processes."""
    from vllm.platforms import cpu as cpu_platform
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention import selector

    class WeightsOnlySparseMLABackend(FlashMLASparseBackend):
        @staticmethod
        def get_impl_cls():
            return _WeightsOnlyImpl

    original = cpu_platform.CpuPlatform.get_attn_backend_cls
    module = types.ModuleType("glm5lab_weights_only_backend")
    module.WeightsOnlySparseMLABackend = WeightsOnlySparseMLABackend
    import sys

    sys.modules[module.__name__] = module

    def get_attn_backend_cls(cls, selected_backend=None, attn_selector_config=None, num_heads=None):
        if attn_selector_config is not None and attn_selector_config.use_sparse:
            return f"{module.__name__}.WeightsOnlySparseMLABackend"
        return original.__func__(cls, selected_backend, attn_selector_config, num_heads)

    cpu_platform.CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cache_clear = getattr(selector._cached_get_attn_backend, "cache_clear", None)
    if cache_clear:
        cache_clear()
    try:
        yield
    finally:
        cpu_platform.CpuPlatform.get_attn_backend_cls = original
        if cache_clear:
            cache_clear()
        sys.modules.pop(module.__name__, None)


def _expected_params(hf_config, reference: dict) -> dict[str, np.ndarray]:
    """What each vLLM parameter must hold, built from the HF checkpoint with vLLM's fusions (and MLA's
    W_UK_T / W_UV, which vLLM derives from kv_b_proj after loading)."""
    exp = {}
    cat = lambda *xs: np.concatenate([reference[x] for x in xs], axis=0)  # noqa: E731
    for name in reference:
        if ".experts." in name and ".shared_experts." not in name:
            continue
        exp[name] = reference[name]
    for layer in range(hf_config.num_hidden_layers):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        exp[f"{a}.fused_qkv_a_proj.weight"] = cat(f"{a}.q_a_proj.weight", f"{a}.kv_a_proj_with_mqa.weight")
        if f"{a}.indexer.wk.weight" in reference:
            exp[f"{a}.indexer.wk_weights_proj.weight"] = cat(f"{a}.indexer.wk.weight",
                                                             f"{a}.indexer.weights_proj.weight")
        for mlp in (f"{p}.mlp", f"{p}.mlp.shared_experts"):
            if f"{mlp}.gate_proj.weight" in reference:
                exp[f"{mlp}.gate_up_proj.weight"] = cat(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
        H, P = hf_config.num_attention_heads, hf_config.qk_nope_head_dim
        per_head = reference[f"{a}.kv_b_proj.weight"].reshape(H, -1, hf_config.kv_lora_rank)
        exp[f"{a}.mla_attn.mla_attn.W_UK_T"] = per_head[:, :P, :]                    # (N, P, L)
        exp[f"{a}.mla_attn.mla_attn.W_UV"] = per_head[:, P:, :].transpose(0, 2, 1)   # (N, L, V)
        if layer >= hf_config.first_k_dense_replace:
            E = hf_config.n_routed_experts
            ex = f"{p}.mlp.experts"
            exp[f"{ex}.routed_experts.w13_weight"] = np.stack(
                [np.concatenate([reference[f"{ex}.{e}.gate_proj.weight"], reference[f"{ex}.{e}.up_proj.weight"]])
                 for e in range(E)])
            exp[f"{ex}.routed_experts.w2_weight"] = np.stack(
                [reference[f"{ex}.{e}.down_proj.weight"] for e in range(E)])
    return exp


CONFIG_KEYS = ("num_attention_heads", "num_key_value_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
               "index_topk", "scoring_func", "topk_method", "indexer_rope_interleave", "tie_word_embeddings")


def vllm_load_report(gguf_path, hf_dir=None, dtype: str = "bfloat16", compare_dir=None) -> dict:
    """Build vLLM's GLM-5 model on CPU from the GGUF through vLLM + the plugin + glm5lab, load the weights
    with vLLM's load_weights, and report. hf_dir: where vLLM takes config.json from (None: the GGUF);
    compare_dir (default hf_dir): HF checkpoint whose values every readable parameter is compared with.
    Needs the glm5lab and gguf plugins registered (done here)."""
    compare_dir = compare_dir if compare_dir is not None else hf_dir
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.plugins import load_general_plugins
    from vllm.utils.torch_utils import set_default_torch_dtype

    load_general_plugins()
    t0 = time.perf_counter()
    gguf_path = Path(gguf_path)
    ea = EngineArgs(model=str(gguf_path), hf_config_path=str(hf_dir) if hf_dir else None,
                    tokenizer=str(hf_dir) if hf_dir else None, skip_tokenizer_init=True,
                    dtype=dtype, max_model_len=256, enforce_eager=True)
    report: dict = {"gguf": gguf_path.name, "dtype": dtype, "config_from": "config.json" if hf_dir else "GGUF"}
    with weights_only_sparse_backend():
        vllm_config = ea.create_engine_config()
        model_config = vllm_config.model_config
        loader = get_model_loader(vllm_config.load_config)
        report["loader"] = type(loader).__module__ + "." + type(loader).__name__
        with set_current_vllm_config(vllm_config):
            if not model_parallel_is_initialized():
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"file://{tempfile.mktemp()}")
                initialize_model_parallel(1, 1)
            adapter = loader._prepare_adapter(model_config)
            report["adapter"] = type(adapter).__name__
            vllm_config.quant_config.unquantized_modules.extend(adapter.load_spec.unquantized_modules)
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
            report["model_class"] = type(model).__module__ + "." + type(model).__name__
            report["config"] = {k: getattr(model_config.hf_config, k, None) for k in CONFIG_KEYS}
            report["model_dtype"] = str(model_config.dtype).replace("torch.", "")
            try:
                loaded = model.load_weights(adapter.prepare_weights(model_config))
                report["refused"] = None
            except (KeyError, ValueError) as exc:  # vLLM refuses a name it has no parameter for
                loaded, report["refused"] = set(), first_line(exc)
            checkpoint_params = set(dict(model.named_parameters()))
            report["missing"] = sorted(checkpoint_params - set(loaded)) if report["refused"] is None else None
            # Float weights as loaded (vLLM's CPU path may repack them for its GEMMs afterwards); quantized
            # ones and MLA's W_UK_T/W_UV exist only after process_weights_after_loading.
            as_loaded = {n: p.detach().clone() for n, p in model.named_parameters()
                         if not isinstance(p, torch.nn.parameter.UninitializedParameter)
                         and p.dtype in (torch.float32, torch.float16, torch.bfloat16) and p.numel() > 0}
            process_weights_after_loading(model, model_config, torch.device("cpu"))
    params = dict(model.named_parameters())
    params.update({n: torch.nn.Parameter(t, requires_grad=False) for n, t in as_loaded.items()
                   if not n.endswith("qweight")})
    report["n_params"] = len(checkpoint_params)
    report["n_quantized_params"] = sum(1 for n in checkpoint_params if n.endswith("qweight"))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if compare_dir is not None:
        reference = _hf_checkpoint(compare_dir)
        expected = _expected_params(model_config.hf_config, reference)
        file_rel = {"F16": F16_REL, "BF16": BF16_REL, "Q8_0": Q8_0_FACTOR / 127}
        allowed = {"bfloat16": BF16_REL, "float16": F16_REL, "float32": 1e-7}[report["model_dtype"]] * 1.01
        allowed += max(file_rel.get(t.tensor_type.name, 0.0) for t in _gguf_tensors(gguf_path))
        rows = [_compare_param(name, p, params, expected) for name, p in params.items()]
        rows = [r for r in rows if r is not None]
        report["params_compared"] = len(rows)
        report["params_not_compared"] = sorted(set(params) - {r[0] for r in rows})
        report["max_rel_err"] = max((r[1] for r in rows), default=None)
        report["worst_param"] = max(rows, key=lambda r: r[1])[0] if rows else None
        report["allowed_rel_err"] = allowed
        report["values_ok"] = report["max_rel_err"] is not None and report["max_rel_err"] <= allowed
    return report


def _gguf_tensors(gguf_path):
    from glm5lab.gguf.reader import open_gguf

    return [t for r in open_gguf(gguf_path).readers for t in r.tensors]


def _compare_param(name, p, params, expected):
    """(name, max |vLLM - expected| / max |expected|) for a parameter we can read back, else None."""
    import gguf as ggufmod
    import torch

    key = name
    if name.endswith("qweight"):
        key = name[: -len("qweight")] + "weight"
        tparam = params.get(name + "_type")
        qtype = getattr(tparam, "weight_type", None)
        if key not in expected or qtype is None:
            return None
        raw = p.detach()
        if raw.dtype == torch.uint8:
            try:
                got = ggufmod.quants.dequantize(raw.numpy(), ggufmod.GGMLQuantizationType(int(qtype)))
            except Exception:  # noqa: BLE001 - a storage layout we cannot read back: not compared
                return None
        else:
            got = raw.to(torch.float64).numpy()
    elif name.endswith("qweight_type"):
        return None
    else:
        if key not in expected or p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None
        got = p.detach().to(torch.float64).numpy()
    ref = expected[key].astype(np.float64)
    if got.shape != ref.shape:
        return name, float("inf")
    return name, float(np.abs(got - ref).max() / (np.abs(ref).max() or 1.0))


# ------------------------------------------------------------------ for notebooks: failures as data

def safely(fn, *args, **kwargs):
    """(result, None) or (None, 'Type: message'): a notebook shows a failed check as data, never raises."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return None, first_line(exc)


def plot_adapter_errors(reports: dict, path, title: str):
    """Bar chart: per HF tensor, max |GGUF-loaded - HF| over the file type's bound (1.0 = at the bound).
    Saved as PNG at `path`; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reports), 1, figsize=(12, 2.6 * len(reports)), squeeze=False)
    for ax, (label, df) in zip(axes[:, 0], reports.items()):
        d = df.dropna(subset=["max_err_over_bound"])
        colors = ["tab:red" if n.endswith("kv_b_proj.weight") else "tab:blue" for n in d["hf_name"]]
        ax.bar(range(len(d)), d["max_err_over_bound"], color=colors)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel("max err / bound")
        ax.set_title(f"{label}: {len(d)} tensors (red: kv_b_proj rebuilt from attn_k_b + attn_v_b; zero bars: "
                     "F32 tensors, exact)", fontsize=9)
        ax.set_xticks([])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return fig


def adapter_summaries(ggufs: dict, hf_dir, out_dir=None) -> tuple[dict, list[dict]]:
    """`adapter_report` for each {qtype: gguf path}: (the reports that ran, one summary row per file; a
    file that fails gives a row with its error). Reports are written to out_dir/adapter_check_<qtype>.csv."""
    reports, summary = {}, []
    for qtype, path in ggufs.items():
        df, err = safely(adapter_report, path, hf_dir)
        if err:
            summary.append({"gguf": qtype, "error": err})
            continue
        reports[qtype] = df
        if out_dir is not None:
            from glm5lab.bench.records import provenance
            from glm5lab.files import write_table

            write_table(df.assign(**provenance(f"glm5lab.vllm_plugin.loader_check.adapter_report({Path(path).name})")),
                        Path(out_dir) / f"adapter_check_{qtype}.csv")
        summary.append({"gguf": qtype, "tensors": int(df["delivered"].sum()),
                        "missing": int((~df["delivered"]).sum()), "unexpected": int((~df["in_checkpoint"]).sum()),
                        "max |err|": float(df["max_abs_err"].max()),
                        "max err / bound": float(df["max_err_over_bound"].max()), "all ok": bool(df["ok"].all())})
    return reports, summary
