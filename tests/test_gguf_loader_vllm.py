"""End to end on the real code, in a fresh process: vLLM loads its general plugins (glm5lab's entry point and
vllm-gguf-plugin's), then builds vLLM 0.32's own GlmMoeDsaForCausalLM on CPU from the tiny GLM-5 GGUFs through
the plugin's GGUFModelLoader and glm5lab's adapter, and loads every weight with vLLM's load_weights."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from glm5lab.vllm_plugin import ledger, gguf_loader as G
    from vllm.transformers_utils.config import get_config_parser
    from vllm_gguf_plugin import weight_utils, weights_adapter
    from glm5lab.vllm_plugin.loader_check import vllm_load_report
    out = {
        "applied": sorted(ledger.APPLIED),
        "first_adapter": weights_adapter._ADAPTER_REGISTRY[0].__name__,
        "gguf_parser": type(get_config_parser("gguf")).__name__,
        "iterator_fixed": weight_utils.gguf_quant_weights_iterator_multi is G.suffix_safe_iterator,
    }
    f16, q8, hf = sys.argv[1:4]
    # F16 with the config built from the GGUF alone (no config.json beside it), values vs the HF checkpoint
    out["f16"] = vllm_load_report(f16, None, "bfloat16", compare_dir=hf)
    # Q8_0 with the HF config.json
    out["q8"] = vllm_load_report(q8, hf, "bfloat16")
    print("JSON" + json.dumps(out, default=str))
""")


@pytest.fixture(scope="module")
def vllm_run(tiny_paths):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_paths.gguf("F16")), str(tiny_paths.gguf("Q8_0")),
                          str(tiny_paths.hf_dir)], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("JSON")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][4:])


def test_entry_point_registers_every_loader_patch(vllm_run):
    from glm5lab.vllm_plugin import gguf_loader as G

    assert set(G.PATCH_NAMES) <= set(vllm_run["applied"])
    assert vllm_run["first_adapter"] == "GlmDsaGGUFWeightsAdapter"
    assert vllm_run["gguf_parser"] == "Glm5labGGUFConfigParser"
    assert vllm_run["iterator_fixed"]


@pytest.mark.parametrize("which", ["f16", "q8"])
def test_vllm_loads_tiny_gguf(vllm_run, which):
    r = vllm_run[which]
    assert r["loader"] == "vllm_gguf_plugin.loader.GGUFModelLoader"
    assert r["adapter"] == "GlmDsaGGUFWeightsAdapter"
    assert r["model_class"].endswith("deepseek_v2.GlmMoeDsaForCausalLM")
    assert r["refused"] is None and r["missing"] == []  # no unexpected name, no parameter left unwritten
    assert r["model_dtype"] == "bfloat16"
    cfg = r["config"]
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    assert (cfg["scoring_func"], cfg["topk_method"], cfg["indexer_rope_interleave"]) == ("sigmoid", "noaux_tc", True)
    # every parameter vLLM holds that can be read back (incl. GGUF qweights and MLA's W_UK_T/W_UV derived from
    # the rebuilt kv_b_proj) equals the HF checkpoint within bf16 + file rounding
    assert r["values_ok"], (r["max_rel_err"], r["worst_param"], r["allowed_rel_err"])
    assert all(n.endswith("qweight_type") for n in r["params_not_compared"]), r["params_not_compared"]
    assert any(n.endswith("W_UK_T") for n in r["params_not_compared"]) is False
    if which == "q8":
        assert r["n_quantized_params"] > 10
        assert r["config"]["tie_word_embeddings"] is False
    else:
        assert r["config_from"] == "GGUF"
