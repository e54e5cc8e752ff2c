"""glm5lab.vllm_plugin.cpu_gguf: vllm-gguf-plugin's quantized ops on CPU tensors, against float math on the
weights gguf dequantizes, for several GGUF block types and every activation dtype the plugin's ops take.

References are float64 products of the dequantized weights and the activations as given; the ops compute in the
activations' dtype, so the tolerances are that dtype's rounding of sums of 256-512 terms of magnitude ~1-10:
relative 1e-5 (float32), 4e-3 (float16), 3e-2 (bfloat16) of the output's largest value."""
import gguf
import numpy as np
import pytest
import torch

pytest.importorskip("vllm_gguf_plugin")

from glm5lab.vllm_plugin import cpu_gguf  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q8_0, QT.Q4_0, QT.Q5_1]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _quantized(shape, qtype, gen):
    """(uint8 blocks as the plugin holds them, float64 values they stand for) of fresh random weights."""
    w = torch.randn(*shape, generator=gen).numpy().astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).double()
    return torch.from_numpy(np.ascontiguousarray(blocks)), values


def _close(got, want, dtype):
    assert got.dtype == dtype
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_dequantize_and_matmuls_equal_float_math_on_the_dequantized_weights(qtype, dtype):
    gen = torch.Generator().manual_seed(int(qtype) * 7 + TYPES.index(qtype))
    rows, cols = 37, 512                                   # an odd row count; columns whole blocks (32 / 256)
    W, w = _quantized((rows, cols), qtype, gen)
    d = cpu_gguf.ggml_dequantize(W, int(qtype), rows, cols, dtype)
    assert d.shape == (rows, cols)
    assert torch.equal(d, w.to(dtype))                      # gguf's values, one rounding to dtype
    for tokens in (1, 5, 70):                              # the plugin's vector and matrix sizes
        X = torch.randn(tokens, cols, generator=gen).to(dtype)
        for op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
            _close(cpu_gguf._CPU_OPS[op](W, X, int(qtype), rows), X.double() @ w.T, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_expert_matmul_keeps_the_plugins_row_order_and_moe_sum_adds_over_top_k(dtype):
    """Row r of ggml_moe_a8_vec is token r // top_k times its (r % top_k)-th expert; the second call of the
    plugin's MoE passes top_k=1 with one input row per (token, expert)."""
    gen = torch.Generator().manual_seed(11)
    E, N, K, T, top_k, qt = 5, 64, 256, 7, 3, int(QT.Q8_0)
    W, w = _quantized((E, N, K), QT.Q8_0, gen)
    X = torch.randn(T, K, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(torch.int32)
    out = cpu_gguf.ggml_moe_a8_vec(X, W, ids, top_k, qt, N, T)
    _close(out, torch.stack([X[r // top_k].double() @ w[ids.flatten()[r]].T for r in range(T * top_k)]), dtype)
    W2, w2 = _quantized((E, 48, N), QT.Q8_0, gen)
    down = cpu_gguf.ggml_moe_a8_vec(out, W2, ids, 1, qt, 48, T * top_k)
    _close(down, torch.stack([out[r].double() @ w2[ids.flatten()[r]].T for r in range(T * top_k)]), dtype)
    out = down
    N = 48
    summed = torch.empty(T, N, dtype=dtype)
    cpu_gguf.moe_sum(out.view(T, top_k, N), summed)
    assert torch.equal(summed, out.view(T, top_k, N).sum(1))


def test_the_wrapped_ops_take_cpu_tensors_only():
    seen = []

    def original(W, *args):
        seen.append("plugin")
        return "plugin"

    op = cpu_gguf._on_cpu("ggml_mul_mat_a8", original, lambda W, *a: "glm5lab")
    assert op(torch.zeros(2, 34, dtype=torch.uint8), None, 8, 2) == "glm5lab"
    assert op(torch.zeros(2, 34, dtype=torch.uint8, device="meta"), None, 8, 2) == "plugin" and seen == ["plugin"]


def test_large_cpu_batches_take_the_plugins_per_token_moe_in_chunks():
    """The plugin's own fused MoE (its Python function, our CPU ops underneath) on 150 tokens: chunked, every chunk
    at most MOE_VEC_MAX_TOKENS, and equal to the per-token float result."""
    from vllm_gguf_plugin.quantization import fused_moe as plugin_moe

    gen = torch.Generator().manual_seed(3)
    E, D, inter, T, top_k = 4, 256, 32, 150, 2
    W1, w1 = _quantized((E, 2 * inter, D), QT.Q8_0, gen)
    W2, w2 = _quantized((E, D, inter), QT.Q8_0, gen)
    x = torch.randn(T, D, generator=gen).to(torch.float32)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, top_k, generator=gen)
    sizes = []

    def plugin(x, *args):
        sizes.append(x.shape[0])
        saved = {n: getattr(plugin_moe.ops, n) for n in cpu_gguf.OPS}
        try:
            for n in cpu_gguf.OPS:
                setattr(plugin_moe.ops, n, cpu_gguf._CPU_OPS[n])
            return plugin_moe._fused_moe_gguf(x, *args)
        finally:
            for n, f in saved.items():
                setattr(plugin_moe.ops, n, f)

    out = cpu_gguf._fused_moe_in_chunks(plugin)(x, W1, W2, weights, ids, int(QT.Q8_0), int(QT.Q8_0), "silu")
    assert sizes == [64, 64, 22]
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(top_k):
            h = x[t].double() @ w1[ids[t, k]].T
            want[t] += weights[t, k] * (torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w2[ids[t, k]].T
    _close(out, want, torch.float32)
