"""fp8_ds_mla layout: byte positions, round trip error, and clear errors."""
import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.kernels.fp8_ds_mla import (FP8_MAX, ROW_BYTES, dequantize_fp8_ds_mla, quantize_fp8_ds_mla)
from tests.seeds import fresh_seed


def _rows(n, dtype=torch.bfloat16, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else fresh_seed())
    # tiles of very different magnitudes, so a shared or misplaced scale would show
    x = torch.randn(n, 576, generator=g)
    x[:, :512] *= torch.logspace(-3, 2, 4).repeat_interleave(128)[torch.randperm(4, generator=g).repeat_interleave(128)]
    return x.to(dtype)


def test_byte_layout_matches_vllm_description():
    """512 e4m3 bytes, then 4 float32 scales (one per 128 values), then 64 bf16 rope values."""
    x = _rows(7)
    c = quantize_fp8_ds_mla(x)
    assert c.dtype == torch.uint8 and c.shape == (7, ROW_BYTES) and ROW_BYTES == 656
    scales = c[:, 512:528].contiguous().view(torch.float32)
    amax = x[:, :512].float().abs().reshape(7, 4, 128).amax(-1)
    torch.testing.assert_close(scales, amax / FP8_MAX, rtol=1e-6, atol=0)
    rope = c[:, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, x[:, 512:].to(torch.bfloat16))
    fp8 = c[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    assert fp8.abs().max() <= FP8_MAX
    # every tile uses its full fp8 range: its largest value maps to +-448
    assert torch.allclose(fp8.abs().reshape(7, 4, 128).amax(-1), torch.full((7, 4), FP8_MAX))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_error_within_e4m3_precision(dtype):
    """e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of a value's magnitude, and values far
    below a tile's max lose more (absolute error <= 2^-4 * 2^-6 ... bounded by scale * 2^-9 subnormal step)."""
    x = _rows(33, dtype)
    y = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    xf = x.float()
    scale = xf[:, :512].abs().reshape(33, 4, 128).amax(-1).clamp(min=1e-4) / FP8_MAX
    bound = (xf[:, :512].abs() * 2.0**-4).reshape(33, 4, 128) + scale[..., None] * 2.0**-9
    err = (y[:, :512] - xf[:, :512]).abs().reshape(33, 4, 128)
    assert bool((err <= bound).all())
    assert torch.equal(y[:, 512:], x[:, 512:].to(torch.bfloat16).float())   # rope: bf16, exact for bf16 input


def test_paged_shape_and_zero_rows():
    x = _rows(2 * 16).reshape(2, 16, 576)
    x[1, 3] = 0                                           # an all-zero row must not divide by zero
    c = quantize_fp8_ds_mla(x)
    assert c.shape == (2, 16, 656)
    y = dequantize_fp8_ds_mla(c, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 16, 576)
    assert bool(torch.isfinite(y.float()).all()) and y[1, 3].abs().max() == 0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(Glm5labError, match="576"):
        quantize_fp8_ds_mla(torch.randn(3, 512))
    with pytest.raises(Glm5labError, match="floating"):
        quantize_fp8_ds_mla(torch.zeros(3, 576, dtype=torch.int32))
    with pytest.raises(Glm5labError, match="656"):
        dequantize_fp8_ds_mla(torch.zeros(3, 576, dtype=torch.uint8))
    with pytest.raises(Glm5labError, match="uint8"):
        dequantize_fp8_ds_mla(torch.zeros(3, 656, dtype=torch.float16))


# ------------------------------------------------- transformers' model with the latent as the layout stores it
def test_latent_cache_rounding_rounds_every_layer_and_removes_its_hooks():
    """Inside the block each layer's latent is what an fp8_ds_mla row gives back (checked at the layernorm's
    output against quantize -> dequantize); the logits move; after the block they are the model's own again."""
    from glm5lab.model.cache_rounding import latent_cache_rounding
    from glm5lab.model.tiny import build_tiny_model

    model = build_tiny_model(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    seen = []
    with torch.no_grad():
        plain = model(ids).logits
        with latent_cache_rounding(model):
            taps = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, a, out: seen.append((a[0], out)))
                    for layer in model.model.layers]    # after the rounding hooks, so they see its result
            rounded = model(ids).logits
            for t in taps:
                t.remove()
        after = model(ids).logits
    assert len(seen) == model.config.num_hidden_layers
    for layer, (x, out) in zip(model.model.layers, seen):
        latent = layer.self_attn.kv_a_layernorm(x)
        row = torch.cat([latent, torch.zeros(*latent.shape[:-1], 64)], dim=-1)
        want = dequantize_fp8_ds_mla(quantize_fp8_ds_mla(row))[..., :512]
        assert torch.equal(out, want), "the hook did not return the fp8_ds_mla round trip"
        assert not torch.equal(out, latent)
    assert (rounded - plain).abs().max() > 1e-4
    assert torch.equal(after, plain)


def test_latent_cache_rounding_refuses_what_it_cannot_model():
    from glm5lab.model.cache_rounding import latent_cache_rounding
    from glm5lab.model.tiny import build_tiny_model, tiny_config

    model = build_tiny_model(config=tiny_config(num_hidden_layers=1))
    with pytest.raises(Glm5labError, match="knows the layouts"):
        with latent_cache_rounding(model, "fp8_e5m2"):
            pass
    narrow = build_tiny_model(config=tiny_config(num_hidden_layers=1, kv_lora_rank=256))
    with pytest.raises(Glm5labError, match="kv_lora_rank is 256"):
        with latent_cache_rounding(narrow):
            pass
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=50))
    with pytest.raises(Glm5labError, match="not an MLA model"):
        with latent_cache_rounding(llama):
            pass
