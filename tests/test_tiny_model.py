"""The tiny GLM-5: real attention geometry, deterministic, and fair (DSA top-k and attention decided by
clear margins, not ties)."""
import json

import pytest
import torch

from glm5lab.model import probe, tiny

PROMPT = ("The quick brown fox jumps over the lazy dog. Tell me a story about a small robot who "
          "learned to count the stars. ") * 3


@pytest.fixture(scope="module")
def model():
    return tiny.build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompt_ids():
    ids = tiny.build_tiny_tokenizer().encode(PROMPT).ids
    assert len(ids) >= 64
    return torch.tensor([ids[:64]])


def test_config_has_glm5_attention_geometry():
    c = tiny.tiny_config()
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.index_head_dim) == (
        512, 64, 192, 256, 128)
    assert c.num_hidden_layers >= 3 and c.first_k_dense_replace >= 1
    assert c.mlp_layer_types[0] == "dense" and "sparse" in c.mlp_layer_types
    assert c.index_topk < 64 <= c.max_position_embeddings
    assert tiny.tiny_config(index_topk=16).index_topk == 16


def test_build_is_deterministic_and_seed_dependent():
    a, b, c = tiny.build_tiny_model(0), tiny.build_tiny_model(0), tiny.build_tiny_model(1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.1.self_attn.kv_b_proj.weight"],
                           sc["model.layers.1.self_attn.kv_b_proj.weight"])
    assert all(v.dtype == torch.float32 for v in sa.values())
    # norms are not all-ones and the router bias is not all-zero (symmetry broken)
    assert sa["model.layers.0.input_layernorm.weight"].std() > 0.01
    assert sa["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0


def test_tokenizer_is_deterministic_and_sized(monkeypatch):
    tok = tiny.build_tiny_tokenizer()
    assert tok.get_vocab_size() == tiny.tiny_config().vocab_size
    monkeypatch.setattr(tiny, "_TOKENIZER_CACHE", None)
    again = tiny.build_tiny_tokenizer()
    assert again.to_str() == tok.to_str()
    ids = tok.encode("Hello world").ids
    assert tok.decode(ids) == "Hello world"


def test_indexer_topk_is_strict_subset_with_clear_margins(model, prompt_ids):
    k = model.config.index_topk
    scores = probe.indexer_scores(model, prompt_ids)
    for layer, s in enumerate(scores):
        assert s is not None, f"layer {layer} has no indexer"
        s = s[0]
        n_keys = torch.arange(1, s.shape[0] + 1)
        assert torch.isinf(s).sum() == (s.shape[0] * (s.shape[0] - 1)) // 2  # causal mask only
        rows = torch.nonzero(n_keys > k).flatten()
        assert len(rows) >= 16  # strict subset is selected on these rows
        srt = s.sort(dim=-1, descending=True).values
        gaps = torch.stack([srt[r, k - 1] - srt[r, k] for r in rows])
        spread = torch.stack([srt[r, 0] - srt[r, r] for r in rows])
        assert (gaps > 0).all(), f"layer {layer}: exact tie at the top-k boundary"
        rel = gaps / spread
        assert (rel > 1e-3).float().mean() >= 0.8, f"layer {layer}: top-k boundary gaps too small: {rel}"
    # the probe's scores reproduce the model's own selection on every row that selects a strict subset
    own = _indexer_outputs(model, prompt_ids)
    for layer, s in enumerate(scores):
        s = s[0]
        rows = torch.nonzero(torch.arange(1, s.shape[0] + 1) > k).flatten()
        sel = s.topk(k, dim=-1).indices
        got = own[layer][0].long()
        assert got.shape == sel.shape == (64, k)
        for r in rows.tolist():
            assert set(sel[r].tolist()) == set(got[r].tolist()), f"layer {layer} row {r}"


def _indexer_outputs(model, prompt_ids):
    """The top-k indices each layer's own DSA indexer returned in a forward pass."""
    got, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: got.__setitem__(i, out)))
    try:
        with torch.no_grad():
            model(prompt_ids)
    finally:
        for h in hooks:
            h.remove()
    return [got.get(i) for i in range(len(model.model.layers))]


def test_attention_is_not_near_uniform(model, prompt_ids):
    for layer, a in enumerate(probe.attention_probs(model, prompt_ids)):
        a = a[0].double()  # [heads, q, k]
        ent = -(a.clamp_min(1e-300).log() * a).sum(-1)[:, 8:]
        n_visible = torch.arange(1, a.shape[-1] + 1).clamp(max=model.config.index_topk)[8:].double()
        ratio = (ent / n_visible.log()).mean().item()
        assert ratio < 0.7, f"layer {layer}: attention entropy is {ratio:.2f} of uniform"


def test_ensure_tiny_writes_once_and_reuses(tmp_path):
    p = tiny.ensure_tiny(tmp_path, qtypes=("F16",))
    cfg = json.loads((p.hf_dir / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["kv_lora_rank"] == 512
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (p.hf_dir / f).exists()
    assert p.gguf("F16").exists() and not p.gguf("Q8_0").exists()
    mtime = p.gguf("F16").stat().st_mtime_ns
    p2 = tiny.ensure_tiny(tmp_path, qtypes=("F16",))
    assert p2 == p and p.gguf("F16").stat().st_mtime_ns == mtime
    assert not [x for x in p.root.iterdir() if x.name.startswith(".")]  # no temp leftovers
    # HF checkpoint loads and equals the generator's weights
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(p.hf_dir).state_dict()
    ref = tiny.build_tiny_model(0).state_dict()
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)


def test_fingerprint_follows_the_generating_code_and_template(monkeypatch):
    """ensure_tiny reuses a cached model by this fingerprint; a changed init rule or chat template used to keep
    the fingerprint, so a stale model was reused."""
    from glm5lab.model import tiny

    base = tiny.generator_fingerprint()
    assert tiny.generator_fingerprint() == base and tiny.generator_fingerprint(seed=1) != base

    def wider_init(name, hidden):
        return ("normal", 0.5)

    monkeypatch.setattr(tiny, "_init_std", wider_init)
    assert tiny.generator_fingerprint() != base
    monkeypatch.undo()
    monkeypatch.setattr(tiny, "CHAT_TEMPLATE", tiny.CHAT_TEMPLATE + " ")
    assert tiny.generator_fingerprint() != base
