"""transformers' GLM-5 with its MLA latent rounded the way a serving engine's KV cache stores it.

Why: an engine with `kv_cache_dtype="fp8_ds_mla"` keeps each token's normalized latent (512 values) as fp8
with one float32 scale per 128 values, and every attention read (prefill too, in sparse MLA) sees those
rounded values. transformers keeps the latent in the model's dtype, so it is not the reference for such
an engine; the same model with the latent rounded through glm5lab's fp8_ds_mla writer and reader is.
The layout stores the rope part in bfloat16; it is left as the model holds it (rounding it too for a float16
model did not bring the engine closer: results/kernels/NOTES.md v47).
"""
from __future__ import annotations

import contextlib

from glm5lab.errors import Glm5labError

LAYOUTS = ("fp8_ds_mla",)


def _round_latent(latent):
    """[..., 512] latent -> the values an fp8_ds_mla cache row gives back, in the latent's dtype."""
    import torch

    from glm5lab.kernels.fp8_ds_mla import LATENT, ROPE, dequantize_fp8_ds_mla, quantize_fp8_ds_mla

    row = torch.cat([latent, latent.new_zeros(*latent.shape[:-1], ROPE)], dim=-1)
    return dequantize_fp8_ds_mla(quantize_fp8_ds_mla(row))[..., :LATENT].to(latent.dtype)


@contextlib.contextmanager
def latent_cache_rounding(model, layout: str = "fp8_ds_mla"):
    """Within the block, every attention layer of `model` (a transformers GlmMoeDsaForCausalLM or
    DeepSeek-V3.2-style model with `self_attn.kv_a_layernorm`) sees its latent as a `layout` cache
    returns it. The hooks are removed on exit, also after an error."""
    if layout not in LAYOUTS:
        raise Glm5labError(f"latent rounding knows the layouts {LAYOUTS}, got {layout!r}")
    from glm5lab.kernels.fp8_ds_mla import LATENT

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    norms = [getattr(getattr(layer, "self_attn", None), "kv_a_layernorm", None) for layer in layers]
    if not norms or any(n is None for n in norms):
        raise Glm5labError(f"{type(model).__name__} has no self_attn.kv_a_layernorm in every layer: not an MLA model")
    rank = model.config.kv_lora_rank
    if rank != LATENT:
        raise Glm5labError(f"{layout} stores a {LATENT}-value latent, this model's kv_lora_rank is {rank}")
    hooks = [n.register_forward_hook(lambda _module, _args, out: _round_latent(out)) for n in norms]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
