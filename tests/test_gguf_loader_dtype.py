"""Which model dtype vLLM 0.32 + vllm-gguf-plugin 0.0.5 accept for GGUF-quantized layers, and the default.

The original deployment needed `--dtype float16` because vLLM's built-in GGUF support of that time rejected
bfloat16. The plugin's GGUFConfig now declares fp16/bf16/fp32 and vLLM checks the model dtype against exactly
that list (VllmConfig._get_quantization_config). Its kernels run only on CUDA tensors (the Triton ones
refuse CPU tensors), so the kernel-level check is a GPU test."""
from __future__ import annotations

import pytest
import torch

from glm5lab.vllm_plugin import gguf_loader as G


def test_plugin_accepts_bf16_and_fp16():
    assert {"bfloat16", "float16"} <= set(G.gguf_supported_act_dtypes())


def test_default_dtype_rule():
    assert G.default_dtype([torch.bfloat16, torch.float16, torch.float32]) == "bfloat16"
    assert G.default_dtype([torch.float16, torch.float32]) == "float16"
    assert G.DEFAULT_DTYPE_NAME == "bfloat16"


def test_gguf_config_carries_the_default_dtype(tiny_paths):
    cfg = G.config_from_gguf(tiny_paths.gguf("Q8_0"))
    assert str(cfg.dtype).replace("torch.", "") == "bfloat16"


def test_plugin_kernels_refuse_cpu_tensors():
    """Why the dtype kernels are checked on the GPU only, and why glm5lab.vllm_plugin.cpu_gguf exists: the plugin's
    own op (as installed, whether or not the CPU patch is applied in this process) needs CUDA tensors."""
    import gguf
    import numpy as np
    from vllm_gguf_plugin import ops

    from glm5lab.vllm_plugin import cpu_gguf

    installed = cpu_gguf._originals.get("ggml_dequantize", ops.ggml_dequantize)
    q = gguf.quants.quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="CUDA"):
        installed(torch.from_numpy(q), int(gguf.GGMLQuantizationType.Q8_0), 4, 32, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plugin_triton_dequant_both_dtypes(dtype):
    """Q8_0 dequant and GEMV/GEMM through the plugin's kernels in fp16 and bf16 vs gguf's numpy reference.
    (Skipped, and reported so, on a GPU machine without vLLM and the plugin, such as the lent H200.)"""
    import gguf
    import numpy as np
    pytest.importorskip("vllm_gguf_plugin", reason="needs vllm-gguf-plugin (and vLLM) installed")
    from vllm_gguf_plugin import ops
    from vllm_gguf_plugin.quantization.linear import _fused_mul_mat_gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    qt = gguf.GGMLQuantizationType.Q8_0
    q = torch.from_numpy(gguf.quants.quantize(w, qt)).cuda()
    ref = torch.from_numpy(gguf.quants.dequantize(q.cpu().numpy(), qt)).double()
    d = ops.ggml_dequantize(q, int(qt), 96, 256, dtype)
    assert d.dtype == dtype
    torch.testing.assert_close(d.double().cpu(), ref, rtol=2 ** -7, atol=1e-3)
    for tokens in (1, 3, 64):
        x = torch.randn(tokens, 256, device="cuda").to(dtype)
        y = _fused_mul_mat_gguf(x, q, int(qt))
        r = x.double().cpu() @ ref.T
        assert y.dtype == dtype
        assert ((y.double().cpu() - r).abs().max() / r.abs().max()).item() < 2e-2  # a8 path quantizes x to 8 bit
