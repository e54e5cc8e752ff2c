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


def hf_config_kwargs_from_gguf(path_or_set) -> dict:
    """Keyword arguments for GlmMoeDsaConfig read from a GGUF file / shard set / GgufSet."""
    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(path_or_set)
    nextn = int(s.arch_key("nextn_predict_layers", 0) or 0)
    n_layers = int(_req(s, "block_count")) - nextn
    rope = int(_req(s, "rope.dimension_count"))
    key_mla = int(_req(s, "attention.key_length_mla"))
    tokens = s.meta("tokenizer.ggml.tokens")
    vocab = s.arch_key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise Glm5labError(f"{s.paths[0]}: cannot tell the vocabulary size")
    heads = int(_req(s, "attention.head_count"))
    indexer_types = s.meta(f"{N.ARCH_NAME}.attention.indexer.types")
    kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=int(_req(s, "embedding_length")),
        intermediate_size=int(_req(s, "feed_forward_length")),
        moe_intermediate_size=int(_req(s, "expert_feed_forward_length")),
        num_hidden_layers=n_layers,
        first_k_dense_replace=int(_req(s, "leading_dense_block_count")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=int(_req(s, "expert_count")),
        n_shared_experts=int(s.arch_key("expert_shared_count", 1)),
        num_experts_per_tok=int(_req(s, "expert_used_count")),
        n_group=int(s.arch_key("expert_group_count", 1) or 1),
        topk_group=int(s.arch_key("expert_group_used_count", 1) or 1),
        routed_scaling_factor=_f32(s.arch_key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(s.arch_key("expert_weights_norm", False)),
        q_lora_rank=int(_req(s, "attention.q_lora_rank")),
        kv_lora_rank=int(_req(s, "attention.kv_lora_rank")),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_mla - rope,
        v_head_dim=int(_req(s, "attention.value_length_mla")),
        index_n_heads=int(_req(s, "attention.indexer.head_count")),
        index_head_dim=int(_req(s, "attention.indexer.key_length")),
        index_topk=int(_req(s, "attention.indexer.top_k")),
        max_position_embeddings=int(_req(s, "context_length")),
        rms_norm_eps=_f32(_req(s, "attention.layer_norm_rms_epsilon")),
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
