"""GLM-5 (`glm_moe_dsa`) GGUF loading for vLLM 0.32 through vllm-gguf-plugin 0.0.5, as ledger patches.

What the installed plugin does wrong for a llama.cpp `glm-dsa` GGUF, and what this module does instead:

* Its default weights adapter maps HF model types to GGUF architectures by hand (deepseek_v2/v3 ->
  deepseek2, ...) and has no `glm_moe_dsa` <-> `glm-dsa` entry: `Unknown gguf model_type: glm_moe_dsa`.
  -> `GlmDsaGGUFWeightsAdapter`, registered first in the plugin's adapter registry, with the full name map
  built from gguf's own `glm-dsa` tables (`glm5lab.gguf.names`).
* llama.cpp splits MLA's `kv_b_proj` into `attn_k_b` (k part, transposed) and `attn_v_b`; vLLM's model wants
  `kv_b_proj`. The plugin's name map (built from gguf's deepseek2 table) only knows `attn_kv_b`, which
  current converters no longer write. In the original deployment's stack a DeepSeek GGUF then loaded with
  `kv_b_proj` never written (the latent DeepSeek bug of the seed story); with plugin 0.0.5 and transformers 5.x
  the default adapter refuses such a file first, naming parameters it cannot map.
  -> the adapter dequantizes both halves and rebuilds `kv_b_proj` exactly (inverse of the converter's split)
  as an unquantized layer (vLLM dequantizes kv_b_proj for MLA's absorbed form anyway).
* `gguf_quant_weights_iterator_multi` renames quantized tensors with `name.replace("weight", "qweight")`,
  which also rewrites `indexer.weights_proj.weight` into `indexer.qweights_proj.qweight`.
  -> patch `gguf-qweight-suffix-rename`: the same iterator, renaming only the suffix.
* The plugin reads the HF config from the GGUF's directory (`config.json`); without one vLLM cannot start.
  -> patch `gguf-config-from-gguf`: the plugin's config parser, extended to build `GlmMoeDsaConfig` from
  the GGUF metadata when the directory has no config.json.
* vLLM's DeepSeek/GLM model code reads three config keys transformers' `GlmMoeDsaConfig` does not define
  (`scoring_func`, `topk_method`, `indexer_rope_interleave`); without them vLLM silently routes with softmax,
  drops the expert-score bias and uses the wrong RoPE layout in the indexer. Both patches above fill them
  when missing (GLM-5's real config.json has them).

Nothing installed is edited: everything is an in-memory replacement recorded in the patch ledger, applied
by `register()` (the `vllm.general_plugins` entry point calls it through `glm5lab.vllm_plugin.PARTS`).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np

from glm5lab.errors import Glm5labError
from glm5lab.vllm_plugin import ledger
from glm5lab.vllm_plugin.ledger import Patch

logger = logging.getLogger("glm5lab.vllm_plugin.gguf_loader")

VERSIONS = {"vllm": ("0.32.0",), "vllm-gguf-plugin": ("0.0.5",)}

ADAPTER_PATCH = "gguf-glm-dsa-weights-adapter"
QWEIGHT_PATCH = "gguf-qweight-suffix-rename"
CONFIG_PATCH = "gguf-config-from-gguf"
PATCH_NAMES = (ADAPTER_PATCH, QWEIGHT_PATCH, CONFIG_PATCH)

# vLLM modules that stay unquantized whatever the GGUF type (built with quant_config=None in vLLM 0.32's
# deepseek_v2.py, or rebuilt here): a quantized GGUF tensor bound for them is dequantized by the adapter.
FLOAT_ONLY_SUFFIXES = (
    ".self_attn.indexer.wq_b.weight",          # ReplicatedLinear: its weight_loader asserts sizes and cannot
                                               # materialize the plugin's uninitialized GGUF qweight (0.0.5)
    ".self_attn.indexer.wk.weight",            # Indexer.wk_weights_proj: MergedColumnParallelLinear(quant_config=None)
    ".self_attn.indexer.weights_proj.weight",  # second shard of the same fused layer
    ".mlp.gate.weight",                        # GateLinear (router), never quantized
    ".self_attn.kv_b_proj.weight",             # rebuilt from attn_k_b/attn_v_b (see join below)
)

# vLLM-only config keys for glm_moe_dsa (read with getattr defaults in vllm/model_executor/models/deepseek_v2.py):
#   scoring_func   default "softmax"  -> GLM-5 routes with sigmoid (GGUF: expert_gating_func = 2)
#   topk_method    default None       -> "noaux_tc" creates gate.e_score_correction_bias (GGUF: exp_probs_b)
#   indexer_rope_interleave default False (neox) -> GLM-5's indexer uses interleaved RoPE (transformers'
#                  GlmMoeDsa indexer calls apply_rotary_pos_emb_interleave; llama.cpp's glm-dsa graph ropes
#                  the indexer with LLAMA_ROPE_TYPE_NORM, the interleaved-pairs layout).
GATING_FUNC_NAMES = {1: "softmax", 2: "sigmoid"}


# ----------------------------------------------------------------------------- names (no vLLM import)

def plugin_suffix_split(raw_name: str) -> tuple[str, str]:
    """Split a name the plugin's iterator yields into (GGUF tensor name, what it carries).

    The iterator (called with raw GGUF names) yields `<base>.weight` or `.bias` for float tensors and, for a
    quantized `<base>.weight`, `<base>.qweight_type` then `<base>.qweight`. GGUF names hold "weight" only as
    their suffix, so the plugin's global replace is harmless on them."""
    for carried in ("qweight_type", "qweight"):
        if raw_name.endswith("." + carried):
            return raw_name[: -len(carried)] + "weight", carried
    return raw_name, raw_name.rsplit(".", 1)[-1]


def rename_suffix(hf_name: str, carried: str) -> str:
    """`x.weight` -> `x.qweight` / `x.qweight_type`: replace only the LAST "weight" (the suffix).

    The plugin replaces every occurrence, turning `indexer.weights_proj.weight` into
    `indexer.qweights_proj.qweight`, a parameter no model has."""
    if carried not in ("qweight", "qweight_type"):
        return hf_name
    i = hf_name.rfind("weight")
    if i < 0:
        return hf_name
    return hf_name[:i] + carried + hf_name[i + len("weight"):]


def gguf_to_hf_name_map(gguf_names, num_hidden_layers: int) -> tuple[dict[str, str], dict[str, str]]:
    """(GGUF name -> HF checkpoint name, GGUF name -> why it is not loaded) for a glm-dsa tensor list.

    1:1 tensors go through gguf's own glm-dsa TensorNameMap (glm5lab.gguf.names); the rest:
    * `attn_k_b` / `attn_v_b` -> gguf's HF names `k_b_proj` / `v_b_proj`, joined into `kv_b_proj` later;
    * `ffn_{gate,up,down}_exps` -> `mlp.experts.0.*_proj.weight`, the plugin's convention for a stacked
      [experts, ...] tensor that its `map_weights` unbinds into one tensor per expert;
    * blocks >= num_hidden_layers (GLM-5's NextN/MTP block) and `nextn.*` are skipped: vLLM's main model
      skips spec-decode layers itself.
    Names that fit none of these are returned by `unknown_tensors`."""
    from glm5lab.gguf import names as N

    T = N.T
    mapping: dict[str, str] = {}
    skipped: dict[str, str] = {}
    expert_kinds = {T.FFN_GATE_EXP: "gate_proj", T.FFN_UP_EXP: "up_proj", T.FFN_DOWN_EXP: "down_proj"}
    for name in gguf_names:
        bid = N.layer_of(name)
        if ".nextn." in name or (bid is not None and bid >= num_hidden_layers):
            skipped[name] = "NextN/MTP block (vLLM's main model skips spec-decode layers)"
            continue
        if bid is not None:
            if name == N.tname(T.ATTN_K_B, bid):
                mapping[name] = f"model.layers.{bid}.self_attn.k_b_proj.weight"
                continue
            if name == N.tname(T.ATTN_V_B, bid):
                mapping[name] = f"model.layers.{bid}.self_attn.v_b_proj.weight"
                continue
            hit = next((proj for kind, proj in expert_kinds.items() if name == N.tname(kind, bid)), None)
            if hit is not None:
                mapping[name] = f"model.layers.{bid}.mlp.experts.0.{hit}.weight"
                continue
        hf = N.gguf_to_hf_simple(name, num_hidden_layers)
        if hf is not None:
            mapping[name] = hf
    return mapping, skipped


def unknown_tensors(gguf_names, mapping: dict, skipped: dict) -> list[str]:
    return [n for n in gguf_names if n not in mapping and n not in skipped]


def kv_b_proj_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def join_kv_b(k_b, v_b):
    """attn_k_b [H, kv_lora, nope] + attn_v_b [H, v, kv_lora] -> kv_b_proj [H*(nope+v), kv_lora] (torch).

    Exact inverse of llama.cpp's DeepseekV2Model.modify_tensors split (view as [H, nope+v, kv_lora], split
    at nope along dim 1, transpose the k part); the numpy twin is glm5lab.gguf.names.join_kv_b."""
    import torch

    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise Glm5labError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not form an MLA "
                           "kv_b_proj (expected [H, kv_lora, nope] and [H, v, kv_lora])")
    dtype = k_b.dtype if k_b.dtype == v_b.dtype else torch.float32
    heads, kv_lora, nope = k_b.shape
    per_head = torch.cat([k_b.to(dtype).transpose(1, 2), v_b.to(dtype)], dim=1)
    return per_head.reshape(heads * (nope + v_b.shape[1]), kv_lora).contiguous()


def dequantize_bytes(raw, qtype: int):
    """Plugin qweight bytes [..., row bytes] -> float32 torch tensor [..., row values] via gguf.quants."""
    import gguf
    import torch

    arr = gguf.quants.dequantize(np.asarray(raw.numpy() if hasattr(raw, "numpy") else raw),
                                 gguf.GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def adapt_weights(raw_weights, mapping: dict[str, str], skipped: dict[str, str], float_expert_dtype=None):
    """Plugin iterator output (raw GGUF names) -> what vLLM's GLM-5 `load_weights` consumes (HF names).

    Quantized tensors keep the plugin's (qweight_type, qweight) pair, renamed on the suffix only; tensors
    bound for unquantized vLLM layers are dequantized; attn_k_b/attn_v_b are rebuilt into kv_b_proj.
    float_expert_dtype: the model's dtype, which float routed experts are cast to (see below)."""
    pending_type: dict[str, int] = {}
    kv_parts: dict[int, dict[str, object]] = {}
    for raw_name, tensor in raw_weights:
        gguf_name, carried = plugin_suffix_split(raw_name)
        if gguf_name in skipped:
            continue
        if gguf_name not in mapping:
            raise Glm5labError(f"GGUF tensor {gguf_name!r} has no GLM-5 (glm_moe_dsa) name")
        hf = mapping[gguf_name]
        if carried == "qweight_type":
            pending_type[gguf_name] = int(tensor)
            continue
        if carried == "qweight":
            qtype = pending_type.pop(gguf_name)
            if hf.endswith(FLOAT_ONLY_SUFFIXES) or hf.endswith(("k_b_proj.weight", "v_b_proj.weight")):
                tensor = dequantize_bytes(tensor, qtype)
            else:
                yield rename_suffix(hf, "qweight_type"), _int_tensor(qtype)
                yield rename_suffix(hf, "qweight"), tensor
                continue
        if ".mlp.experts.0." in hf and carried == "weight":
            # vllm-gguf-plugin gives every routed-expert layer its GGUF MoE method (qweight params only),
            # whatever the file's type; float experts travel as (qweight_type = their float GGML type, qweight).
            # Its MoE multiplies activations by a float qweight as stored (`x @ qweight.T`), so an F16 file in a
            # bfloat16 model (the default dtype) failed with "expected m1 and m2 to have the same dtype": the
            # experts take the model's dtype here, as every other float weight does when vLLM copies it in.
            if float_expert_dtype is not None and tensor.dtype != float_expert_dtype:
                tensor = tensor.to(float_expert_dtype)
            yield rename_suffix(hf, "qweight_type"), _int_tensor(_float_ggml_type(tensor))
            yield rename_suffix(hf, "qweight"), tensor
            continue
        if hf.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):
            layer = int(hf.split(".")[2])
            part = "k" if hf.endswith("k_b_proj.weight") else "v"
            kv_parts.setdefault(layer, {})[part] = tensor
            if len(kv_parts[layer]) == 2:
                parts = kv_parts.pop(layer)
                yield kv_b_proj_name(layer), join_kv_b(parts["k"], parts["v"])
            continue
        yield hf, tensor
    if kv_parts:
        missing = {layer: "attn_v_b" if "k" in p else "attn_k_b" for layer, p in kv_parts.items()}
        raise Glm5labError(f"GGUF lacks half of kv_b for layers {missing}")


def _float_ggml_type(tensor) -> int:
    import gguf
    import torch

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    if tensor.dtype not in names:
        raise Glm5labError(f"unexpected dtype {tensor.dtype} for a float GGUF tensor")
    return int(gguf.GGMLQuantizationType[names[tensor.dtype]])


def _int_tensor(value: int):
    import torch

    return torch.tensor(value)


def unquantized_modules(tensor_types: dict[str, str], mapping: dict[str, str]) -> list[str]:
    """vLLM module prefixes that must get plain (unquantized) weights: float GGUF tensors, the rebuilt
    kv_b_proj and the layers vLLM never quantizes."""
    mods = set()
    for gguf_name, hf in mapping.items():
        if not hf.endswith(".weight"):
            continue
        if hf.endswith(("k_b_proj.weight", "v_b_proj.weight")):     # either half names the rebuilt kv_b_proj
            hf = hf.rsplit(".", 2)[0] + ".kv_b_proj.weight"
        if tensor_types.get(gguf_name) in ("F32", "F16", "BF16") or hf.endswith(FLOAT_ONLY_SUFFIXES):
            mods.add(hf[: -len(".weight")])
    return sorted(mods)


# ----------------------------------------------------------------------------- config

def vllm_config_extras(gguf_path=None, hf_config=None) -> dict:
    """The vLLM-only glm_moe_dsa config keys (see module doc), from the GGUF when one is given."""
    extras = {"indexer_rope_interleave": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    if gguf_path is not None:
        from glm5lab.gguf import names as N
        from glm5lab.gguf.reader import open_gguf

        s = open_gguf(gguf_path)
        extras["scoring_func"] = GATING_FUNC_NAMES.get(int(s.arch_key("expert_gating_func", 2) or 2), "sigmoid")
        has_bias = any(N.layer_of(n) is not None and n.endswith("exp_probs_b.bias") for n in s.tensor_index)
        extras["topk_method"] = "noaux_tc" if has_bias else None
    return extras


def fill_vllm_config_keys(hf_config, gguf_path=None) -> list[str]:
    """Set the vLLM-only keys that `hf_config` lacks; returns the keys it set (existing values win)."""
    if getattr(hf_config, "model_type", None) != "glm_moe_dsa":
        return []
    set_keys = []
    for key, value in vllm_config_extras(gguf_path).items():
        if getattr(hf_config, key, None) is None and value is not None:
            setattr(hf_config, key, value)
            set_keys.append(key)
    if set_keys:
        logger.info("glm5lab: glm_moe_dsa config lacked %s; set from %s", set_keys,
                    "the GGUF" if gguf_path else "GLM-5 defaults")
    return set_keys


def find_glm_dsa_gguf(directory: Path) -> Path | None:
    """The one glm-dsa GGUF (or first shard of one split set) in a directory; None if there is none."""
    from glm5lab.gguf.reader import architecture, open_reader, shard_siblings

    candidates = []
    for p in sorted(Path(directory).glob("*.gguf")):
        sib = shard_siblings(p)
        if sib and p != sib[0]:
            continue
        try:
            if architecture(open_reader(p)) == "glm-dsa":
                candidates.append(p)
        except Glm5labError:
            continue
    if len(candidates) > 1:
        raise Glm5labError(f"{directory}: several glm-dsa GGUFs ({', '.join(c.name for c in candidates)}); "
                           "pass the GGUF file itself or --hf-config-path")
    return candidates[0] if candidates else None


def config_from_gguf(gguf_path):
    """GlmMoeDsaConfig for vLLM from GGUF metadata alone (glm5lab.gguf.config + vLLM keys + dtype rule)."""
    from glm5lab.gguf.config import hf_config_from_gguf

    cfg = hf_config_from_gguf(gguf_path)
    fill_vllm_config_keys(cfg, gguf_path)
    cfg.dtype = DEFAULT_DTYPE_NAME  # what "--dtype auto" resolves to (see default_dtype)
    return cfg


# The dtype rule. vLLM 0.32 checks the model dtype against the quantization config's
# get_supported_act_dtypes(). vLLM's own GGUFConfig (before GGUF support moved out to the plugin) returned
# [float16, float32] when `current_platform.has_device_capability(100)` ("GGUF dequantization kernels use half
# precision internally; bfloat16 has precision issues on Blackwell") -- a >= test that also caught SM120, the
# original deployment's RTX PRO 6000, hence its `--dtype float16`; later vLLM narrowed it to the SM10x family.
# Plugin 0.0.5's GGUFConfig returns [float16, bfloat16, float32] on every GPU, and its Triton
# dequant/GEMM/MoE kernels accept both half types (tests/test_gguf_loader_dtype.py, a GPU test). bfloat16 is
# GLM-5's own dtype and the one most of vLLM's sparse MLA backends take (FLASHMLA_SPARSE and
# FLASHINFER_MLA_SPARSE_SM120 only bf16; FLASH_ATTN_MLA_SPARSE on SM90 and FlashInfer's TRTLLM sparse on SM100 also
# fp16), so it is the default; float16 only where the platform lacks bf16. Caveat kept from vLLM's note: on SM10x
# the GGUF CUDA kernels were once reported imprecise in bf16 -- check with the GPU test before serving there.
DEFAULT_DTYPE_NAME = "bfloat16"


def default_dtype(platform_dtypes=None) -> str:
    """'bfloat16' unless the platform cannot run it (then 'float16')."""
    if platform_dtypes is None:
        from vllm.platforms import current_platform

        platform_dtypes = current_platform.supported_dtypes
    names = {str(d).replace("torch.", "") for d in platform_dtypes}
    return "bfloat16" if "bfloat16" in names else "float16"


def gguf_supported_act_dtypes() -> list[str]:
    """What the installed plugin's GGUFConfig accepts as vLLM model dtype."""
    from vllm_gguf_plugin.quantization import GGUFConfig

    return [str(d).replace("torch.", "") for d in GGUFConfig().get_supported_act_dtypes()]


# ----------------------------------------------------------------------------- the adapter (imports vLLM)

@functools.cache
def adapter_class():
    """GlmDsaGGUFWeightsAdapter: a subclass of the plugin's default adapter (built lazily: imports vLLM)."""
    from vllm_gguf_plugin import weight_utils
    from vllm_gguf_plugin.gguf_utils import maybe_patch_hf_config_from_gguf
    from vllm_gguf_plugin.weights_adapter.base import GGUFLoadSpec
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    class GlmDsaGGUFWeightsAdapter(GGUFWeightsAdapter):
        """llama.cpp `glm-dsa` GGUF -> vLLM GlmMoeDsaForCausalLM weights (see glm5lab.vllm_plugin.gguf_loader)."""

        skipped: dict[str, str]

        @classmethod
        def matches(cls, config) -> bool:
            return getattr(config, "model_type", None) == "glm_moe_dsa"

        def patch_hf_config(self, model_path, hf_config):
            hf_config = maybe_patch_hf_config_from_gguf(model_path, hf_config)  # vocab size from the tokenizer
            from glm5lab.gguf.config import hf_config_from_gguf, require_same_geometry
            from glm5lab.gguf.reader import open_gguf

            s = open_gguf([Path(f) for f in self._get_all_gguf_files(model_path)])   # every shard's headers, once
            # the plugin took hf_config from the tokenizer folder's config.json when it has one (or from
            # --hf-config-path): another model's would lay these tensors out by its numbers, so `vllm serve` is
            # refused here as `glm5lab generate` is before it starts an engine
            require_same_geometry(hf_config_from_gguf(s), hf_config, s.paths[0].name, "the config vLLM was given")
            # The plugin calls lm_head tied when any shard lacks output.weight (it collects missing names shard by
            # shard), which is true of nearly every split GGUF; output.weight may sit in any one shard.
            hf_config.update({"tie_word_embeddings": "output.weight" not in s.tensor_index})
            fill_vllm_config_keys(hf_config, s)
            return hf_config

        @staticmethod
        def _tensor_types(files) -> dict[str, str]:
            import gguf

            return {t.name: t.tensor_type.name for f in files for t in gguf.GGUFReader(f).tensors}

        def prepare_loading(self, model_path, model_config):
            model_config.hf_config = self.patch_hf_config(model_path, model_config.hf_config)
            files = self._get_all_gguf_files(model_path)
            types = self._tensor_types(files)
            mapping, skipped = gguf_to_hf_name_map(types, model_config.hf_config.num_hidden_layers)
            unknown = unknown_tensors(types, mapping, skipped)
            if unknown:
                raise Glm5labError(f"{model_path}: {len(unknown)} tensors have no GLM-5 name, e.g. {unknown[:3]}")
            self.skipped = skipped
            self.load_spec = GGUFLoadSpec(weights_source=list(files),
                                          unquantized_modules=unquantized_modules(types, mapping),
                                          gguf_to_hf_name_map=mapping)
            return self.load_spec

        def prepare_weights(self, model_config):
            # The plugin's own reader, on raw GGUF names (looked up at call time, so a patched one is used).
            raw = weight_utils.gguf_quant_weights_iterator_multi(self.load_spec.weights_source, None)
            yield from self.map_weights(adapt_weights(raw, self.load_spec.gguf_to_hf_name_map, self.skipped,
                                                      float_expert_dtype=getattr(model_config, "dtype", None)))

    return GlmDsaGGUFWeightsAdapter


# ----------------------------------------------------------------------------- the patches

_ORIGINALS: dict[str, object] = {}


def original_iterator():
    """The plugin's unpatched gguf_quant_weights_iterator_multi (for probes and tests)."""
    from vllm_gguf_plugin import weight_utils

    return _ORIGINALS.get("gguf_quant_weights_iterator_multi", weight_utils.gguf_quant_weights_iterator_multi)


def suffix_safe_iterator(gguf_files, gguf_to_hf_name_map=None):
    """Drop-in for the plugin's gguf_quant_weights_iterator_multi: same tensors, same order, same dtypes,
    but `x.weight` of a quantized tensor becomes `x.qweight(_type)` by its suffix only."""
    original = original_iterator()
    if gguf_to_hf_name_map is None:
        yield from original(gguf_files, None)
        return
    for raw_name, tensor in original(gguf_files, None):
        gguf_name, carried = plugin_suffix_split(raw_name)
        if gguf_name not in gguf_to_hf_name_map:
            continue
        yield rename_suffix(gguf_to_hf_name_map[gguf_name], carried), tensor


def _apply_adapter() -> None:
    from vllm_gguf_plugin import weights_adapter

    cls = adapter_class()
    if cls not in weights_adapter._ADAPTER_REGISTRY:
        weights_adapter._ADAPTER_REGISTRY.insert(0, cls)


def _apply_qweight_fix() -> None:
    from vllm_gguf_plugin import weight_utils
    from vllm_gguf_plugin.weights_adapter import default, gemma3

    if "gguf_quant_weights_iterator_multi" not in _ORIGINALS:
        _ORIGINALS["gguf_quant_weights_iterator_multi"] = weight_utils.gguf_quant_weights_iterator_multi
    for module in (weight_utils, default, gemma3):  # each imported the function by name
        module.gguf_quant_weights_iterator_multi = suffix_safe_iterator


@functools.cache
def config_parser_class():
    from vllm_gguf_plugin.config_parser import GGUFConfigParser

    class Glm5labGGUFConfigParser(GGUFConfigParser):
        """The plugin's GGUF config parser, plus: no config.json beside a glm-dsa GGUF -> config from the
        GGUF metadata; glm_moe_dsa configs get the vLLM-only keys they lack."""

        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            path = Path(str(model))
            source = path.parent if path.is_file() else path
            if source.is_dir() and not (source / "config.json").exists():
                gguf_path = path if path.is_file() else find_glm_dsa_gguf(source)
                if gguf_path is not None:
                    config = config_from_gguf(gguf_path)
                    return config.to_dict(), config
            config_dict, config = super().parse(model, trust_remote_code, revision=revision,
                                                code_revision=code_revision, **kwargs)
            gguf_path = path if path.is_file() else None
            if fill_vllm_config_keys(config, gguf_path):
                config_dict = config.to_dict()
            return config_dict, config

    return Glm5labGGUFConfigParser


def synthesized_config_dir(gguf_path) -> Path:
    """A directory holding the config.json built from this GGUF's metadata (cached by path, size, mtime;
    written to a temporary name and renamed, so a reader never sees half a file)."""
    import hashlib

    from glm5lab.files import make_folder, write_json
    from glm5lab.model.tiny import cache_root

    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf-configs" / key
    if not (out / "config.json").exists():
        cfg = config_from_gguf(gguf_path)
        make_folder(out)
        (out / "SOURCE").write_text(str(gguf_path) + "\n")
        write_json(cfg.to_dict(), out / "config.json", indent=2)       # last: its presence means the folder is done
    return out


def _config_source_wrapper(original):
    """The plugin points vLLM's `model` at the GGUF's directory (or --tokenizer) and reads config.json there.
    When that directory has none and the GGUF is glm-dsa, point it at a directory holding the config.json
    built from the GGUF metadata instead (vLLM keeps treating `model` as a directory, as it expects)."""

    @functools.wraps(original)
    def _get_gguf_config_source(model, tokenizer, hf_config_path):
        source = original(model, tokenizer, hf_config_path)
        path = Path(str(model))
        if hf_config_path is None and path.is_file() and Path(str(source)).is_dir() \
                and not (Path(str(source)) / "config.json").exists():
            from glm5lab.gguf.reader import architecture, open_reader

            if architecture(open_reader(path)) == "glm-dsa":
                return str(synthesized_config_dir(path))
        return source

    return _get_gguf_config_source


def _apply_config_parser() -> None:
    from vllm.transformers_utils.config import _CONFIG_FORMAT_TO_CONFIG_PARSER
    from vllm_gguf_plugin import plugin

    if "_get_gguf_config_source" not in _ORIGINALS:
        _ORIGINALS["_get_gguf_config_source"] = plugin._get_gguf_config_source
        plugin._get_gguf_config_source = _config_source_wrapper(plugin._get_gguf_config_source)

    # Assigned directly (not via register_config_parser) to avoid its "overwritten" warning in every process;
    # the plugin's own register() keeps a parser that is an instance of its GGUFConfigParser, as this one is.
    _CONFIG_FORMAT_TO_CONFIG_PARSER["gguf"] = config_parser_class()


ledger.add(Patch(
    name=ADAPTER_PATCH,
    why="vllm-gguf-plugin's default adapter has no glm_moe_dsa <-> glm-dsa mapping ('Unknown gguf model_type: "
        "glm_moe_dsa'), knows MLA only as attn_kv_b (llama.cpp now writes attn_k_b + attn_v_b, which it "
        "cannot map), and would quantize layers vLLM keeps in float (indexer wk/weights_proj); its MoE "
        "multiplies by float experts as stored, so an F16 file in a bfloat16 model failed on dtypes",
    how="GlmDsaGGUFWeightsAdapter inserted first in vllm_gguf_plugin.weights_adapter._ADAPTER_REGISTRY: full "
        "name map from gguf's glm-dsa tables, kv_b_proj rebuilt from attn_k_b/attn_v_b (exact inverse of "
        "llama.cpp's split), MTP block skipped, float-only targets dequantized, tie_word_embeddings from all "
        "shards, vLLM-only config keys (scoring_func, topk_method, indexer_rope_interleave) filled when missing, "
        "float routed experts cast to the model's dtype; a config whose tensor geometry disagrees with the GGUF's "
        "metadata (the plugin reads config.json from the tokenizer folder) refused by name",
    upstream="vllm-gguf-plugin: no GLM-DSA adapter in 0.0.5 (candidate upstream PR: this adapter)",
    remove_when="the plugin ships an adapter for glm_moe_dsa that reassembles kv_b_proj from attn_k_b/attn_v_b",
    versions=VERSIONS, apply=_apply_adapter))

ledger.add(Patch(
    name=QWEIGHT_PATCH,
    why="gguf_quant_weights_iterator_multi renames quantized tensors with name.replace('weight', 'qweight'): "
        "a quantized '...indexer.weights_proj.weight' becomes '...indexer.qweights_proj.qweight' (no such "
        "parameter). llama.cpp's converter keeps indexer.proj F32; other quantizers need not",
    how="vllm_gguf_plugin.weight_utils / weights_adapter.default / weights_adapter.gemma3 "
        "gguf_quant_weights_iterator_multi -> a wrapper that runs the original on raw GGUF names and renames "
        "the last 'weight' only",
    upstream="vllm-gguf-plugin weight_utils.py (same global replace inherited from vLLM's old gguf loader)",
    remove_when="the plugin's iterator renames only the '.weight' suffix",
    versions=VERSIONS, apply=_apply_qweight_fix))

ledger.add(Patch(
    name=CONFIG_PATCH,
    why="the plugin's GGUF config parser reads config.json from the GGUF's directory; a bare GGUF cannot start "
        "vLLM, and a config.json without GLM-5's vLLM-only keys routes experts with softmax and no bias",
    how="'gguf' config parser -> Glm5labGGUFConfigParser (subclass of the plugin's): no config.json -> "
        "GlmMoeDsaConfig from the GGUF metadata (glm5lab.gguf.config) with dtype bfloat16; otherwise the "
        "plugin's parse plus the missing vLLM keys. vllm_gguf_plugin.plugin._get_gguf_config_source wrapped: "
        "with no config.json beside the GGUF, vLLM's model directory is one holding the config.json built from "
        "the GGUF (cached under the glm5lab cache)",
    upstream="vllm-gguf-plugin config_parser.py (GGUF-only configs are not supported)",
    remove_when="the plugin builds HF configs from GGUF metadata for glm-dsa",
    versions=VERSIONS, apply=_apply_config_parser))


def register() -> None:
    """Apply this part's ledger patches (each checks the installed vLLM and plugin versions first)."""
    errors = []
    for name in PATCH_NAMES:
        try:
            ledger.apply(name)
        except Glm5labError as exc:
            errors.append(str(exc))
    if errors:
        raise Glm5labError("; ".join(errors))
