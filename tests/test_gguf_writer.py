"""HF -> glm-dsa GGUF -> read back: names from gguf's tables, llama.cpp's kv_b split, exact values for
float types, Q8_0 within its block error, metadata -> the same GlmMoeDsaConfig."""
import gguf
import numpy as np
import pytest
import torch

from glm5lab.gguf import names as N
from glm5lab.gguf.config import hf_config_from_gguf
from glm5lab.gguf.reader import open_gguf, read_gguf_tensors, read_hf_tensors
from glm5lab.gguf.writer import convert_hf_to_gguf, hf_tensor_loaders, shard_paths
from glm5lab.model.tiny import tiny_config


@pytest.fixture(scope="module")
def source(tiny_paths):
    return {k: f() for k, f in hf_tensor_loaders(tiny_paths.hf_dir).items()}


def _stored_f32(name, x):
    """llama.cpp keeps 1-D tensors, norms, the router and the indexer's per-head weights in F32."""
    return x.ndim == 1 or "norm" in name or name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight"))


def _bf16(x):
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def test_names_come_from_the_glm_dsa_table(tiny_paths):
    s = open_gguf(tiny_paths.gguf("F16"))
    known = {gguf.TENSOR_NAMES[k] for k in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA]}
    for t in s.first.tensors:
        bid = N.layer_of(t.name)
        base = t.name.rsplit(".", 1)[0]
        generic = base.replace(f"blk.{bid}.", "blk.{bid}.") if bid is not None else base
        assert generic in known, t.name
    names = set(s.tensor_index)
    for bid in range(3):
        assert f"blk.{bid}.attn_k_b.weight" in names and f"blk.{bid}.attn_v_b.weight" in names
        assert f"blk.{bid}.attn_kv_b.weight" not in names  # llama.cpp writes only the split halves
        for ix in ("attn_q_b", "attn_k", "k_norm", "proj"):
            assert f"blk.{bid}.indexer.{ix}.weight" in names
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    for kind in ("gate_exps", "up_exps", "down_exps", "gate_shexp", "gate_inp"):
        assert f"blk.1.ffn_{kind}.weight" in names
    assert "blk.1.exp_probs_b.bias" in names


def test_kv_b_split_matches_llama_cpp_layout(tiny_paths, source):
    cfg = tiny_config()
    H, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    t = read_gguf_tensors(tiny_paths.gguf("F16"), ["blk.2.attn_k_b.weight", "blk.2.attn_v_b.weight"])
    k_b, v_b = t["blk.2.attn_k_b.weight"], t["blk.2.attn_v_b.weight"]
    assert k_b.shape == (H, r, nope) and v_b.shape == (H, v, r)
    kv_b = torch.from_numpy(source["model.layers.2.self_attn.kv_b_proj.weight"]).view(H, nope + v, r)
    for h in range(H):
        want_k = kv_b[h, :nope, :].T.numpy().astype(np.float16).astype(np.float32)
        want_v = kv_b[h, nope:, :].numpy().astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(k_b[h], want_k)
        np.testing.assert_array_equal(v_b[h], want_v)
    # ggml ne order is the reverse of numpy's
    tk = open_gguf(tiny_paths.gguf("F16")).tensor("blk.2.attn_k_b.weight")
    assert [int(x) for x in tk.shape] == [nope, r, H]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_round_trip_is_exact(tiny_paths, source, tmp_path, qtype):
    path = tiny_paths.gguf(qtype) if qtype == "F16" else convert_hf_to_gguf(
        tiny_paths.hf_dir, tmp_path / f"t-{qtype}.gguf", qtype=qtype, progress=False)[0]
    back = read_hf_tensors(path)
    assert set(back) == set(source)
    types = {gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in open_gguf(path).first.tensors}
    assert types == ({"F32"} if qtype == "F32" else {"F32", qtype})
    for name, x in source.items():
        y = back[name]
        if qtype == "F32" or _stored_f32(name, x):
            want = x
        elif qtype == "F16":
            want = x.astype(np.float16).astype(np.float32)
        else:
            want = _bf16(x)
        np.testing.assert_array_equal(y, want, err_msg=name)


def test_q8_0_within_block_error(tiny_paths, source):
    back = read_hf_tensors(tiny_paths.gguf("Q8_0"))
    s = open_gguf(tiny_paths.gguf("Q8_0"))
    assert any(int(t.tensor_type) == gguf.GGMLQuantizationType.Q8_0 for t in s.first.tensors)
    worst = 0.0
    for name, x in source.items():
        y = back[name]
        if _stored_f32(name, x):
            np.testing.assert_array_equal(y, x, err_msg=name)
            continue
        # Q8_0: blocks of 32 along the last dim, d = amax/127 (stored f16), |x - q*d| <= d/2 (+ f16 d rounding)
        if name.endswith("kv_b_proj.weight"):  # compare in the layout that was quantized (k_b transposed)
            continue
        xb = x.reshape(-1, 32)
        d = np.abs(xb).max(axis=1, keepdims=True) / 127
        err = np.abs(y.reshape(-1, 32) - xb)
        assert (err <= 0.6 * d + 1e-12).all(), name
        worst = max(worst, float((err / np.maximum(d, 1e-30)).max()))
    assert worst > 0.3  # it really is quantized, not stored exactly
    kb = read_gguf_tensors(s, ["blk.1.attn_k_b.weight"])["blk.1.attn_k_b.weight"]
    H = kb.shape[0]
    exact = source["model.layers.1.self_attn.kv_b_proj.weight"].reshape(H, -1, kb.shape[1])[:, :kb.shape[2], :]
    xb = exact.transpose(0, 2, 1).reshape(-1, 32)
    d = np.abs(xb).max(axis=1, keepdims=True) / 127
    assert (np.abs(kb.reshape(-1, 32) - xb) <= 0.6 * d + 1e-12).all()


def test_metadata_gives_back_the_hf_config(tiny_paths):
    cfg, ref = hf_config_from_gguf(tiny_paths.gguf("Q8_0")), tiny_config()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
                "norm_topk_prob", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "eos_token_id", "pad_token_id", "rope_parameters",
                "indexer_types", "mlp_layer_types"):
        assert getattr(cfg, key) == getattr(ref, key), key
    s = open_gguf(tiny_paths.gguf("Q8_0"))
    assert s.meta("general.architecture") == "glm-dsa"
    assert s.arch_key("attention.head_count_kv") == 1
    assert s.arch_key("attention.key_length") == 512 + 64 and s.arch_key("attention.value_length") == 512
    assert s.meta("tokenizer.ggml.model") == "gpt2"
    assert len(s.meta("tokenizer.ggml.tokens")) == ref.vocab_size
    assert len(s.meta("tokenizer.ggml.merges")) > 100


def test_writer_shards_directly(tiny_paths, tmp_path):
    paths = convert_hf_to_gguf(tiny_paths.hf_dir, tmp_path / "m.gguf", qtype="F16", n_shards=3, progress=False)
    assert [p.name for p in paths] == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert paths == shard_paths(tmp_path / "m.gguf", 3)
    s = open_gguf(paths[1])  # any shard opens the whole set
    assert s.is_split and s.paths == paths
    assert [s.readers[i].fields["split.no"].contents() for i in range(3)] == [0, 1, 2]
    one = read_gguf_tensors(tiny_paths.gguf("F16"))
    many = read_gguf_tensors(s)
    assert list(one) == list(many)
    assert all(np.array_equal(one[k], many[k]) for k in one)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]  # no temp leftovers


def test_tokenizer_rebuilt_from_gguf_matches_hf(tiny_paths, tmp_path):
    """transformers cannot load a glm-dsa GGUF's tokenizer; glm5lab.gguf.tokenizer rebuilds it exactly."""
    from transformers import AutoTokenizer

    from glm5lab.gguf.tokenizer import tokenizer_from_gguf, write_hf_tokenizer

    ref = AutoTokenizer.from_pretrained(tiny_paths.hf_dir)
    tok = tokenizer_from_gguf(tiny_paths.gguf("Q8_0"))
    texts = ["Hello world. The quick brown fox, 12345 don't\n\n  x", "[gMASK]<sop><|user|>hi<|assistant|>",
             "ünïcødé 日本語 🙂 <|unused_3|>"]
    for s in texts:
        ids = tok(s).input_ids
        assert ids == ref(s).input_ids and tok.decode(ids) == s
    assert tok.eos_token == ref.eos_token and len(tok) == len(ref) == tiny_config().vocab_size
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    again = AutoTokenizer.from_pretrained(write_hf_tokenizer(tiny_paths.gguf("F16"), tmp_path / "tok"))
    assert again(texts[0]).input_ids == ref(texts[0]).input_ids


def test_shared_indexer_layers_round_trip(tiny_paths, tmp_path):
    """GLM-5.x "IndexShare": layers marked shared have no indexer tensors; the per-layer roles travel as
    glm-dsa.attention.indexer.types (bool per layer, llama.cpp's key) and come back in the HF config."""
    from glm5lab.gguf.writer import write_gguf
    from glm5lab.model.tiny import build_tiny_model

    cfg = tiny_config(indexer_types=["full", "shared", "full"])
    model = build_tiny_model(seed=1, config=cfg)
    loaders = {k: (lambda v=v: v.detach().numpy()) for k, v in model.state_dict().items()}
    path = write_gguf(loaders, cfg, tiny_paths.hf_dir, tmp_path / "share.gguf", qtype="F32", progress=False)[0]
    s = open_gguf(path)
    assert list(s.meta("glm-dsa.attention.indexer.types")) == [True, False, True]
    assert not [n for n in s.tensor_index if n.startswith("blk.1.indexer.")]
    assert "blk.2.indexer.proj.weight" in s.tensor_index
    assert hf_config_from_gguf(path).indexer_types == ["full", "shared", "full"]
    back = read_hf_tensors(path)
    for k, v in model.state_dict().items():
        if k.endswith(("gate_up_proj", "experts.down_proj")):
            continue
        np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)


def test_hf_model_from_gguf(tiny_paths, tmp_path):
    """F32 GGUF -> HF model gives the generator's logits exactly; Q8_0 gives the dequantized weights."""
    from glm5lab.gguf.reader import hf_model_from_gguf
    from glm5lab.model.tiny import build_tiny_model

    ids = torch.arange(3, 67).unsqueeze(0)
    ref = build_tiny_model(0)
    f32 = convert_hf_to_gguf(tiny_paths.hf_dir, tmp_path / "f32.gguf", qtype="F32", progress=False)[0]
    m = hf_model_from_gguf(f32)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, ref(ids).logits)
    q = hf_model_from_gguf(tiny_paths.gguf("Q8_0"))
    kv = read_hf_tensors(tiny_paths.gguf("Q8_0"), ["model.layers.1.self_attn.kv_b_proj.weight"])
    assert torch.equal(q.state_dict()["model.layers.1.self_attn.kv_b_proj.weight"],
                       torch.from_numpy(kv["model.layers.1.self_attn.kv_b_proj.weight"]))
    with torch.no_grad():
        assert torch.isfinite(q(ids).logits).all()
