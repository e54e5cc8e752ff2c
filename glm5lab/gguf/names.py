"""GLM-5 tensor names and shapes on both sides: HF checkpoint <-> llama.cpp `glm-dsa` GGUF.

The GGUF names come from gguf's own tables (`MODEL_TENSORS[MODEL_ARCH.GLM_DSA]`, `TENSOR_NAMES`,
`get_tensor_name_map`), never from string literals, so a gguf release that renames a tensor breaks here
loudly. The two layout changes are llama.cpp's (convert_hf_to_gguf.py, `DeepseekV2Model.modify_tensors`,
which `GlmMoeDsaModel` inherits):

* `kv_b_proj` [H*(nope+v), kv_lora] is split per head into `attn_k_b` = k part transposed
  [H, kv_lora, nope] and `attn_v_b` [H, v, kv_lora], so MLA can run "absorbed" (q_nope @ k_b, then
  latent @ v_b) without re-slicing at load time.
* the per-expert `mlp.experts.{e}.{gate,up,down}_proj` matrices are stacked into 3-D `ffn_*_exps`.

Shapes here are numpy/torch order (slowest first), i.e. the reverse of ggml's `ne`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import gguf

ARCH = gguf.MODEL_ARCH.GLM_DSA
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "glm-dsa"
T = gguf.MODEL_TENSOR

# Every tensor kind the GLM-DSA table knows, for validation of files we did not write.
_ARCH_TENSORS = set(gguf.MODEL_TENSORS[ARCH])


def tname(kind: "gguf.MODEL_TENSOR", bid: int | None = None, suffix: str = ".weight") -> str:
    """GGUF name of one tensor kind, from gguf's table (refuses kinds GLM-DSA does not have)."""
    if kind not in _ARCH_TENSORS:
        raise KeyError(f"{kind!r} is not a {ARCH_NAME} tensor")
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + suffix


@dataclass(frozen=True)
class Geometry:
    """The hyperparameters that decide GLM-5 tensor shapes (from an HF config or GGUF metadata)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    indexer_full: tuple[bool, ...]
    tie_word_embeddings: bool = False
    nextn_layers: int = 0

    @classmethod
    def from_hf(cls, config, nextn_layers: int | None = None) -> "Geometry":
        types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        nextn = nextn_layers if nextn_layers is not None else int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, moe_intermediate_size=config.moe_intermediate_size,
            num_hidden_layers=config.num_hidden_layers, first_k_dense_replace=config.first_k_dense_replace,
            num_attention_heads=config.num_attention_heads, n_routed_experts=config.n_routed_experts,
            n_shared_experts=config.n_shared_experts, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
            indexer_full=tuple(t == "full" for t in types),
            tie_word_embeddings=bool(config.tie_word_embeddings), nextn_layers=nextn,
        )

    def is_moe_layer(self, bid: int) -> bool:
        return bid >= self.first_k_dense_replace


def gguf_tensor_specs(g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor of a glm-dsa file, in the order the writer emits them.

    MTP/NextN blocks (nextn_layers > 0, only used for size estimates here) are full decoder blocks
    numbered after the main ones, plus the nextn.* tensors."""
    H, D = g.num_attention_heads, g.hidden_size
    specs: list[tuple[str, tuple[int, ...]]] = [(tname(T.TOKEN_EMBD), (g.vocab_size, D))]
    for bid in range(g.num_hidden_layers + g.nextn_layers):
        s = [
            (tname(T.ATTN_NORM, bid), (D,)),
            (tname(T.ATTN_Q_A, bid), (g.q_lora_rank, D)),
            (tname(T.ATTN_Q_A_NORM, bid), (g.q_lora_rank,)),
            (tname(T.ATTN_Q_B, bid), (H * (g.qk_nope_head_dim + g.qk_rope_head_dim), g.q_lora_rank)),
            (tname(T.ATTN_KV_A_MQA, bid), (g.kv_lora_rank + g.qk_rope_head_dim, D)),
            (tname(T.ATTN_KV_A_NORM, bid), (g.kv_lora_rank,)),
            (tname(T.ATTN_K_B, bid), (H, g.kv_lora_rank, g.qk_nope_head_dim)),
            (tname(T.ATTN_V_B, bid), (H, g.v_head_dim, g.kv_lora_rank)),
            (tname(T.ATTN_OUT, bid), (D, H * g.v_head_dim)),
        ]
        main_layer = bid < g.num_hidden_layers
        if not main_layer or g.indexer_full[bid]:
            s += [
                (tname(T.INDEXER_ATTN_Q_B, bid), (g.index_n_heads * g.index_head_dim, g.q_lora_rank)),
                (tname(T.INDEXER_ATTN_K, bid), (g.index_head_dim, D)),
                (tname(T.INDEXER_K_NORM, bid), (g.index_head_dim,)),
                (tname(T.INDEXER_K_NORM, bid, ".bias"), (g.index_head_dim,)),
                (tname(T.INDEXER_PROJ, bid), (g.index_n_heads, D)),
            ]
        s.append((tname(T.FFN_NORM, bid), (D,)))
        if g.is_moe_layer(bid):
            E, I = g.n_routed_experts, g.moe_intermediate_size
            Ish = I * g.n_shared_experts
            s += [
                (tname(T.FFN_GATE_INP, bid), (E, D)),
                (tname(T.FFN_EXP_PROBS_B, bid, ".bias"), (E,)),
                (tname(T.FFN_GATE_EXP, bid), (E, I, D)),
                (tname(T.FFN_UP_EXP, bid), (E, I, D)),
                (tname(T.FFN_DOWN_EXP, bid), (E, D, I)),
                (tname(T.FFN_GATE_SHEXP, bid), (Ish, D)),
                (tname(T.FFN_UP_SHEXP, bid), (Ish, D)),
                (tname(T.FFN_DOWN_SHEXP, bid), (D, Ish)),
            ]
        else:
            s += [
                (tname(T.FFN_GATE, bid), (g.intermediate_size, D)),
                (tname(T.FFN_UP, bid), (g.intermediate_size, D)),
                (tname(T.FFN_DOWN, bid), (D, g.intermediate_size)),
            ]
        if not main_layer:
            s += [
                (tname(T.NEXTN_EH_PROJ, bid), (D, 2 * D)),
                (tname(T.NEXTN_ENORM, bid), (D,)),
                (tname(T.NEXTN_HNORM, bid), (D,)),
                (tname(T.NEXTN_SHARED_HEAD_NORM, bid), (D,)),
            ]
        specs += s
    specs.append((tname(T.OUTPUT_NORM), (D,)))
    if not g.tie_word_embeddings:
        specs.append((tname(T.OUTPUT), (g.vocab_size, D)))
    return specs


_BLK = re.compile(r"^blk\.(\d+)\.")


def layer_of(gguf_name: str) -> int | None:
    m = _BLK.match(gguf_name)
    return int(m.group(1)) if m else None


def component_of(gguf_name: str, n_main_layers: int | None = None, first_dense: int | None = None) -> str:
    """attention / indexer / MoE / dense / embedding / MTP: what a tensor belongs to, for size tables."""
    bid = layer_of(gguf_name)
    if bid is None:
        return "embedding"  # token_embd, output_norm, output (the vocab-sized ends of the model)
    if (n_main_layers is not None and bid >= n_main_layers) or ".nextn." in gguf_name:
        return "MTP"
    rest = gguf_name[len(f"blk.{bid}."):]
    if rest.startswith("indexer."):
        return "indexer"
    if rest.startswith("attn_"):
        return "attention"
    if "_exps" in rest or "_shexp" in rest or rest.startswith(("ffn_gate_inp", "exp_probs_b")):
        return "MoE"
    if rest.startswith("ffn_norm") and first_dense is not None:
        return "dense" if bid < first_dense else "MoE"
    return "dense"


def hf_to_gguf_simple(hf_name: str, n_blocks: int) -> str | None:
    """Name of an HF tensor that maps 1:1 (no split/stack), via gguf's own TensorNameMap."""
    if hf_name.endswith("e_score_correction_bias"):  # HF buffer name -> the `.bias` form the map knows
        hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
    tmap = gguf.get_tensor_name_map(ARCH, n_blocks)
    return tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def gguf_to_hf_simple(gguf_name: str, n_blocks: int) -> str | None:
    """Inverse of hf_to_gguf_simple for the tensors that map 1:1 (HF checkpoint naming)."""
    return _inverse_map(n_blocks).get(gguf_name)


_INV_CACHE: dict[int, dict[str, str]] = {}

_HF_LAYER_SUFFIXES = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.o_proj.weight",
    "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias", "self_attn.indexer.weights_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
]


def _inverse_map(n_blocks: int) -> dict[str, str]:
    if n_blocks not in _INV_CACHE:
        inv = {}
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        names += [f"model.layers.{b}.{s}" for b in range(n_blocks) for s in _HF_LAYER_SUFFIXES]
        for n in names:
            g = hf_to_gguf_simple(n, n_blocks)
            if g is not None:
                inv[g] = n
        _INV_CACHE[n_blocks] = inv
    return _INV_CACHE[n_blocks]


# ---- the two layout changes, both directions (numpy arrays) ----

def split_kv_b(kv_b, n_heads: int, nope: int, v: int):
    """HF kv_b_proj [H*(nope+v), kv_lora] -> (attn_k_b [H, kv_lora, nope], attn_v_b [H, v, kv_lora])."""
    kv_lora = kv_b.shape[-1]
    per_head = kv_b.reshape(n_heads, nope + v, kv_lora)
    k_b = per_head[:, :nope, :].transpose(0, 2, 1)
    v_b = per_head[:, nope:, :]
    return k_b.copy(), v_b.copy()


def join_kv_b(k_b, v_b):
    """Inverse of split_kv_b: (attn_k_b, attn_v_b) -> kv_b_proj [H*(nope+v), kv_lora]."""
    import numpy as np

    H, kv_lora, nope = k_b.shape
    v = v_b.shape[1]
    per_head = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return per_head.reshape(H * (nope + v), kv_lora)


EXPERT_PROJ = {"gate_proj": T.FFN_GATE_EXP, "up_proj": T.FFN_UP_EXP, "down_proj": T.FFN_DOWN_EXP}
