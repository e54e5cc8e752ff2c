"""GLM-5 on CUDA: which of vLLM 0.32's two DSA model implementations runs, so that glm5lab's parts are called.

vLLM 0.32 resolves `GlmMoeDsaForCausalLM` through `vllm.models.deepseek_v32`. On CUDA that is its `nvidia` model:
`DeepseekV32Attention` prepares q and writes the caches in fused CUDA kernels, calls vLLM's DeepGEMM indexer function
directly (not the `SparseAttnIndexer` custom op), and calls backend hooks that only vLLM's own sparse backends have
(`record_logical_topk_ready`). Elsewhere (CPU, XPU) it is the generic `deepseek_v2` model, whose MLA layer calls the
selected backend's `forward_mqa` and whose indexer is the `SparseAttnIndexer` custom op. glm5lab's TRITON_MLA_SPARSE
backend and its indexer op plug into the generic model, the path glm5lab's CPU tests run through vLLM.

So on CUDA the plugin registers its own `GlmMoeDsaForCausalLM` with vLLM's model registry. When vLLM builds it, it
builds the generic model if glm5lab serves a part of GLM-5 (`generic_model_reason`: glm5lab's indexer, or the attention
backend vLLM's selector picks is TRITON_MLA_SPARSE), and vLLM's CUDA model otherwise (SM90 / SM100 with vLLM's own
sparse backends and DeepGEMM). `GLM5LAB_DSA_MODEL=generic|vllm` overrides the choice. The NextN draft model of
speculative decoding (`DeepseekV32MTP`) is not routed. Neither model has run on a GPU with vLLM here (the lent GPUs
have no vLLM); see the ledger entry.
"""
from __future__ import annotations

import logging
import os

from glm5lab.vllm_plugin import ledger
from glm5lab.vllm_plugin.backend_enum import BACKEND_NAME
from glm5lab.vllm_plugin.ledger import Patch

logger = logging.getLogger("glm5lab.vllm_plugin")

ARCH = "GlmMoeDsaForCausalLM"
MODEL_ENV = "GLM5LAB_DSA_MODEL"
CHOICES = ("auto", "generic", "vllm")
PATCH_NAME = "cuda: GLM-5 through vLLM's generic DSA model where glm5lab serves it"
VLLM_VERSIONS = {"vllm": ("0.32.0",)}
_CLASS = None


def model_choice() -> str:
    """GLM5LAB_DSA_MODEL, checked: `auto` (default), `generic` or `vllm`."""
    choice = os.environ.get(MODEL_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{MODEL_ENV}={os.environ[MODEL_ENV]!r}: expected one of {', '.join(CHOICES)}")
    return choice


def selected_attention_backend(vllm_config) -> str | None:
    """The sparse MLA backend vLLM's selector picks for this model and config (the call its MLA layers make), or None
    when it picks none: asked before the model is built, so that the model that will call it can be chosen."""
    from vllm.v1.attention.selector import get_attn_backend

    hf = vllm_config.model_config.hf_text_config
    heads = hf.num_attention_heads // vllm_config.parallel_config.tensor_parallel_size
    try:
        backend = get_attn_backend(hf.kv_lora_rank + hf.qk_rope_head_dim, vllm_config.model_config.dtype,
                                   vllm_config.cache_config.cache_dtype, use_mla=True, use_sparse=True,
                                   num_heads=heads)
    except ValueError as exc:    # no valid backend: the layers will raise the same when they are built
        logger.info("glm5lab: vLLM's selector picks no sparse MLA backend here (%s)", exc)
        return None
    return backend.get_name()


def generic_model_reason(vllm_config, backend_name=selected_attention_backend) -> str | None:
    """Why GLM-5 must be built from vLLM's generic DSA model here (a part of it is glm5lab's), or None."""
    from glm5lab.vllm_plugin.indexer_op import vllm_indexer_blocker

    choice = model_choice()
    if choice != "auto":
        return f"{MODEL_ENV}={choice}" if choice == "generic" else None
    blocker = vllm_indexer_blocker()
    if blocker is not None:
        return f"glm5lab's DSA indexer serves it ({blocker})"
    if backend_name(vllm_config) == BACKEND_NAME:
        return f"the attention backend is {BACKEND_NAME}"
    return None


def dispatching_class(vllm_cls, generic_cls, reason=generic_model_reason):
    """A subclass of vLLM's CUDA model (so the registry reads vLLM's interfaces from it) that, when vLLM builds it,
    builds the generic model instead where `reason(vllm_config)` gives a reason, and vLLM's own otherwise."""

    class GlmMoeDsaForCausalLM(vllm_cls):
        def __new__(cls, *, vllm_config, prefix: str = ""):
            why = reason(vllm_config)
            target = generic_cls if why else vllm_cls
            logger.info("glm5lab: GLM-5 built from %s.%s%s", target.__module__, target.__qualname__,
                        f" ({why})" if why else "")
            return target(vllm_config=vllm_config, prefix=prefix)   # not an instance of cls: no second __init__

    GlmMoeDsaForCausalLM.__module__, GlmMoeDsaForCausalLM.__qualname__ = __name__, ARCH
    return GlmMoeDsaForCausalLM


def __getattr__(name: str):
    """The registered class, built on first use (vLLM's registry imports `glm5lab.vllm_plugin.dsa_model` and reads
    `GlmMoeDsaForCausalLM`): it needs vLLM's CUDA model, which only a CUDA build of vLLM imports."""
    global _CLASS
    if name != ARCH:
        raise AttributeError(name)
    if _CLASS is None:
        from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM as generic_cls
        from vllm.models.deepseek_v32 import GlmMoeDsaForCausalLM as vllm_cls

        _CLASS = vllm_cls if vllm_cls is generic_cls else dispatching_class(vllm_cls, generic_cls)
    return _CLASS


def _register_model() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCH, f"{__name__}:{ARCH}")


ledger.add(Patch(
    name=PATCH_NAME,
    why="on CUDA vLLM 0.32 builds GLM-5 from vllm.models.deepseek_v32.nvidia, whose attention calls vLLM's DeepGEMM "
        "indexer function directly (glm5lab's indexer op is never called; SM8x has no such kernels) and backend "
        "hooks TRITON_MLA_SPARSE lacks (record_logical_topk_ready); glm5lab's backend and indexer plug into vLLM's "
        "generic DSA model (deepseek_v2, what vLLM runs on CPU and XPU)",
    how="vllm.ModelRegistry.register_model('GlmMoeDsaForCausalLM', 'glm5lab.vllm_plugin.dsa_model:"
        "GlmMoeDsaForCausalLM'), on CUDA only: a subclass of vLLM's CUDA model whose __new__ builds the generic model "
        "where glm5lab serves a part (its indexer, or TRITON_MLA_SPARSE as the selector's pick) and vLLM's own "
        "otherwise; GLM5LAB_DSA_MODEL=generic|vllm overrides. Not run on a GPU with vLLM here",
    upstream="none (vLLM's CUDA DSA model is written for its own sparse backends and DeepGEMM)",
    remove_when="vLLM's CUDA DSA model calls the SparseAttnIndexer op and only the MLA backend interface, or "
                "glm5lab's backend implements the hooks that model calls",
    versions=VLLM_VERSIONS,
    apply=_register_model,
))


def register() -> None:
    """Plugin part: on CUDA, route GLM-5 through glm5lab's choice of model; elsewhere vLLM already builds the
    generic one."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    model_choice()      # a mistyped GLM5LAB_DSA_MODEL stops this part when the plugin loads (vLLM's log names it)
    ledger.apply(PATCH_NAME)
