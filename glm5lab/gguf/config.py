"""GGUF metadata (glm-dsa.* keys) -> the equivalent transformers GlmMoeDsaConfig.

vLLM (and HF) build the model from a config; a GGUF carries the same numbers under llama.cpp's key names,
with two MLA conventions undone here: head_count_kv is 1 in the file (MQA over the latent) but the HF
config counts query heads, and key_length_mla/value_length_mla are the per-head nope+rope / v sizes.
"""
from __future__ import annotations

from glm5lab.errors import Glm5labError
from glm5lab.gguf import names as N


def _f32(v) -> float:
    """GGUF stores float32: give back the short decimal it came from (1e-05, not 9.99999974e-06)."""
    import numpy as np

    return float(str(np.float32(v)))


def _req(s, suffix: str):
    v = s.arch_key(suffix)
    if v is None:
        raise Glm5labError(f"{s.paths[0]}: missing metadata key {N.ARCH_NAME}.{suffix}")
    return v


def _int(s, suffix: str, minimum: int = 1, default=None) -> int:
    """A geometry key as an int of at least `minimum`: a string, a float or a 0 head count there would otherwise
    surface as a ValueError from int(), or as a reshape error inside vLLM after the engine has loaded."""
    v = _req(s, suffix) if default is None else s.arch_key(suffix, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise Glm5labError(f"{s.paths[0]}: metadata {N.ARCH_NAME}.{suffix} is {type(v).__name__} {v!r}, expected "
                           f"an integer >= {minimum}")
    return v


def _positive_float(s, suffix: str) -> float:
    v = _req(s, suffix)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise Glm5labError(f"{s.paths[0]}: metadata {N.ARCH_NAME}.{suffix} is {type(v).__name__} {v!r}, expected "
                           f"a positive number")
    return _f32(v)


def hf_config_kwargs_from_gguf(path_or_set) -> dict:
    """Keyword arguments for GlmMoeDsaConfig read from a GGUF file / shard set / GgufSet."""
    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(path_or_set)
    nextn = _int(s, "nextn_predict_layers", minimum=0, default=0)
    n_layers = _int(s, "block_count") - nextn
    if n_layers < 1:
        raise Glm5labError(f"{s.paths[0]}: metadata {N.ARCH_NAME}.block_count {n_layers + nextn} leaves no layer "
                           f"besides its {nextn} next-token prediction layer(s)")
    rope = _int(s, "rope.dimension_count")
    key_mla = _int(s, "attention.key_length_mla", minimum=rope + 1)
    tokens = s.meta("tokenizer.ggml.tokens")
    vocab = s.arch_key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise Glm5labError(f"{s.paths[0]}: cannot tell the vocabulary size")
    heads = _int(s, "attention.head_count")
    indexer_types = s.meta(f"{N.ARCH_NAME}.attention.indexer.types")
    kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=_int(s, "embedding_length"),
        intermediate_size=_int(s, "feed_forward_length"),
        moe_intermediate_size=_int(s, "expert_feed_forward_length"),
        num_hidden_layers=n_layers,
        first_k_dense_replace=_int(s, "leading_dense_block_count", minimum=0),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=_int(s, "expert_count"),
        n_shared_experts=_int(s, "expert_shared_count", minimum=0, default=1),
        num_experts_per_tok=_int(s, "expert_used_count"),
        n_group=int(s.arch_key("expert_group_count", 1) or 1),
        topk_group=int(s.arch_key("expert_group_used_count", 1) or 1),
        routed_scaling_factor=_f32(s.arch_key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(s.arch_key("expert_weights_norm", False)),
        q_lora_rank=_int(s, "attention.q_lora_rank"),
        kv_lora_rank=_int(s, "attention.kv_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_mla - rope,
        v_head_dim=_int(s, "attention.value_length_mla"),
        index_n_heads=_int(s, "attention.indexer.head_count"),
        index_head_dim=_int(s, "attention.indexer.key_length"),
        index_topk=_int(s, "attention.indexer.top_k"),
        max_position_embeddings=_int(s, "context_length"),
        rms_norm_eps=_positive_float(s, "attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": float(s.arch_key("rope.freq_base", 10000.0))},
        tie_word_embeddings=N.tname(N.T.OUTPUT) not in s.tensor_index,
        eos_token_id=s.meta("tokenizer.ggml.eos_token_id"),
        bos_token_id=s.meta("tokenizer.ggml.bos_token_id"),
        pad_token_id=s.meta("tokenizer.ggml.padding_token_id"),
    )
    if indexer_types is not None:
        kwargs["indexer_types"] = ["full" if bool(x) else "shared" for x in indexer_types]
    return kwargs


def hf_config_from_gguf(path_or_set):
    """transformers.GlmMoeDsaConfig equivalent to a glm-dsa GGUF's metadata."""
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(**hf_config_kwargs_from_gguf(path_or_set))
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    return cfg


# the geometry a GGUF's tensors are laid out by: a config that disagrees on any of these cannot load them. Settings
# that lay out no tensor (index_topk, num_experts_per_tok, rope, eps) may differ: an override of them is a choice.
GEOMETRY_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                 "n_routed_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace")


def geometry_disagreements(gguf_config, other_config) -> dict[str, tuple]:
    """{key: (the GGUF metadata's value, the other config's)} for GEOMETRY_KEYS where they differ. vllm-gguf-plugin
    builds a GGUF's model from the config.json of the folder given as its tokenizer when there is one, not from the
    GGUF's metadata: a tokenizer folder of another model (or size) would lay the tensors out by the wrong numbers."""
    out = {}
    for key in GEOMETRY_KEYS:
        a, b = getattr(gguf_config, key, None), getattr(other_config, key, None)
        if a is not None and b is not None and a != b:
            out[key] = (a, b)
    return out


def require_same_geometry(gguf_config, other_config, gguf_name: str, other_name: str) -> None:
    """Refuse a config that would lay a GGUF's tensors out by another model's numbers (geometry_disagreements)."""
    differ = geometry_disagreements(gguf_config, other_config)
    if differ:
        shown = ", ".join(f"{k} {a} in the GGUF, {b} there" for k, (a, b) in list(differ.items())[:3])
        raise Glm5labError(f"{other_name} describes another model than {gguf_name} ({shown}); vLLM would build the "
                           f"GGUF's model from it: give a tokenizer folder (or --hf-config-path) of this model")
