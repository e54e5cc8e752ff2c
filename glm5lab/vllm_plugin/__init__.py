"""The one wing of glm5lab that imports vLLM (lazily): loader fixes, backend doctor, the
TRITON_MLA_SPARSE attention backend and the DSA indexer op.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it starts.
Each part registers itself through vLLM's own hooks and records what it changed in the patch ledger
(`glm5lab.vllm_plugin.ledger`); a part written for other vLLM versions refuses with a clear message.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("glm5lab.vllm_plugin")

# (module, function) of each part, in the order vLLM needs them. A part missing from this list is not
# registered; a part that raises is logged with its reason and the others still register.
PARTS: list[tuple[str, str]] = []
PARTS.append(("glm5lab.vllm_plugin.sparse_backend", "register"))  # issue 7: TRITON_MLA_SPARSE
PARTS.append(("glm5lab.vllm_plugin.cpu_sparse", "register"))  # issue 10: sparse MLA on vLLM CPU
PARTS.append(("glm5lab.vllm_plugin.indexer_op", "register"))  # issue 9: DSA indexer op (OOT)
PARTS.append(("glm5lab.vllm_plugin.dsa_model", "register"))  # CUDA: GLM-5 through the model glm5lab's parts serve
PARTS.append(("glm5lab.vllm_plugin.gguf_loader", "register"))  # issue 4: GLM-5 GGUF loader fixes
PARTS.append(("glm5lab.vllm_plugin.cpu_gguf", "register"))  # quantized GGUF tensors on vLLM CPU

_registered = False


def register() -> None:
    """Entry point for `vllm.general_plugins` (idempotent: vLLM may call it more than once)."""
    global _registered
    if _registered:
        return
    import importlib

    for module_name, func_name in PARTS:
        try:
            getattr(importlib.import_module(module_name), func_name)()
        except Exception as exc:  # one broken part must not stop vLLM from starting
            logger.warning("glm5lab: %s.%s not registered: %s", module_name, func_name, exc)
    _registered = True
