"""The inspector: its numbers equal what the writer wrote, it summarizes (not dumps) tokenizer arrays,
it recovers the HF config, and it reads headers only (a 400+ GB GLM-5-shaped file costs a few MB)."""
import resource

import gguf
import numpy as np
import pytest

from glm5lab.gguf.inspect import estimate_real_glm5, inspect_gguf, tensor_table_for_config
from glm5lab.gguf.reader import open_gguf
from glm5lab.gguf.writer import encode, gguf_tensors_from_hf, hf_tensor_loaders, tensor_type, write_skeleton_gguf
from glm5lab.gguf import names as N
from glm5lab.model.tiny import tiny_config


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_inspector_numbers_equal_the_writers(tiny_paths, qtype):
    path = tiny_paths.gguf(qtype)
    r = inspect_gguf(path)
    cfg = tiny_config()
    # recompute what the writer encodes, tensor by tensor
    qt = gguf.GGMLQuantizationType[qtype]
    expected = {}
    for name, arr in gguf_tensors_from_hf(hf_tensor_loaders(tiny_paths.hf_dir), N.Geometry.from_hf(cfg)):
        t = tensor_type(name, arr.shape, qt)
        expected[name] = (t.name, tuple(arr.shape), int(encode(arr, t).nbytes))
    got = {row.name: (row.ggml_type, row.shape, row.bytes) for row in r.tensors.itertuples()}
    assert got == expected
    assert r.header["tensors"] == len(expected)
    assert r.header["tensor_bytes"] == sum(v[2] for v in expected.values())
    assert r.header["file_bytes"] == path.stat().st_size
    assert r.header["file_bytes"] >= r.header["header_bytes"] + r.header["tensor_bytes"]
    assert r.by_component["bytes"].sum() == r.header["tensor_bytes"] == r.by_type["bytes"].sum()
    assert set(r.tensors.component) == {"embedding", "attention", "indexer", "dense", "MoE"}
    # the planner used for the real-GLM-5 estimate agrees with the file
    plan = tensor_table_for_config(cfg, qtype).set_index("name")
    assert (plan.loc[r.tensors.name, "bytes"].to_numpy() == r.tensors.bytes.to_numpy()).all()
    assert r.hf_config.kv_lora_rank == 512 and r.hf_config.index_topk == cfg.index_topk
    assert r.hyperparams["attention.key_length_mla"] == 256


def test_metadata_arrays_are_summarized(tiny_paths):
    r = inspect_gguf(tiny_paths.gguf("F16"))
    tokens = r.metadata.set_index("key").loc["tokenizer.ggml.tokens"]
    assert tokens["type"] == "ARRAY[STRING]"
    assert str(tokens["value"]).startswith("[512 x STRING]") and len(str(tokens["value"])) < 200


def test_inspection_reads_headers_only(tmp_path):
    """A real-GLM-5-geometry file (78 layers + MTP, 256 experts) with a sparse 400+ GB data section:
    reading its data would fault ~1e8 pages; inspection must stay within a few thousand."""
    from transformers import GlmMoeDsaConfig

    path = write_skeleton_gguf(GlmMoeDsaConfig(), tmp_path / "glm5-skeleton.gguf", "Q4_K", nextn_layers=1)
    size = path.stat().st_size
    assert size > 300e9 and path.stat().st_blocks * 512 < 50e6  # sparse on disk
    before = resource.getrusage(resource.RUSAGE_SELF)
    r = inspect_gguf(path)
    after = resource.getrusage(resource.RUSAGE_SELF)
    faults = (after.ru_minflt - before.ru_minflt) + (after.ru_majflt - before.ru_majflt)
    assert faults * 4096 < 200e6 < size / 1000, faults
    assert r.header["tensors"] == len(r.tensors) > 1500
    assert r.hf_config.num_hidden_layers == 78 and r.hf_config.n_routed_experts == 256
    assert r.hyperparams["nextn_predict_layers"] == 1 and r.hyperparams["block_count"] == 79
    est = estimate_real_glm5(("Q4_K",), nextn_layers=1)
    assert est["bytes"].sum() == r.header["tensor_bytes"]
    by_c = r.tensors.groupby("component")["bytes"].sum()
    assert (est.set_index("component")["bytes"].sort_index() == by_c.sort_index()).all()
    assert by_c.idxmax() == "MoE"


def test_estimate_is_labeled_and_plausible():
    est = estimate_real_glm5(("Q4_K", "Q8_0"))
    assert est["label"].str.contains("estimate").all()
    total = est.groupby("qtype")["bytes"].sum()
    params = est[est.qtype == "Q8_0"]["params"].sum()
    assert 7.0e11 < params < 8.0e11  # GLM-5: ~744B parameters (+ the MTP block)
    assert 4.4 < total["Q4_K"] * 8 / params < 5.0  # Q4_K is 4.5 bits/weight, a few fallbacks above
    assert 8.4 < total["Q8_0"] * 8 / params < 8.6
    np.testing.assert_array_less(total["Q4_K"], total["Q8_0"])


def test_shard_set_inspection(tiny_paths, tmp_path):
    from glm5lab.gguf.shards import split_gguf

    parts = split_gguf(tiny_paths.gguf("Q8_0"), 3, tmp_path / "t.gguf", progress=False)
    one, many = inspect_gguf(tiny_paths.gguf("Q8_0")), inspect_gguf(parts[2])
    assert many.header["shards"] == 3 and sorted(many.tensors.shard.unique()) == [1, 2, 3]
    assert (one.tensors[["name", "bytes", "ggml_type"]].to_numpy() == many.tensors[["name", "bytes", "ggml_type"]]
            .to_numpy()).all()
    assert open_gguf(parts[0]).is_split
