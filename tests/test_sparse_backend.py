"""TRITON_MLA_SPARSE through vLLM 0.32's own code, on CPU.

Selector: vLLM's CUDA platform class with the capability pinned (no GPU needed) picks glm5lab's backend
for SM120 + fp16 + sparse + GLM-5 when asked, and refuses with vLLM's own reasons when not.
forward_mqa: on fresh random inputs, a batch mixing decode and prefill tokens of several requests
(request-local top-k with -1 anywhere and indices past a request's length, paged block tables with blocks
out of order) equals glm5lab's float64 reference computed on global slots built independently here.
Tolerances (the kernel's, justified in tests/test_sparse_mla_kernel.py): fp32 accumulation and two
roundings to the input dtype (P before P.V, and the output), so relative Frobenius error <= 4u and every
element within 8u * max|ref|, u = 2^-8 (bf16) or 2^-11 (fp16); a wrong slot, row or head gives O(1).
"""
import math

import pytest
import torch

vllm = pytest.importorskip("vllm")

from glm5lab.vllm_plugin import sparse_backend as sb  # noqa: E402
from glm5lab.vllm_plugin.backend_enum import BACKEND_PATH  # noqa: E402
from glm5lab.sparse.reference import sparse_mla_reference  # noqa: E402

GLM5_SCALE = 1 / math.sqrt(192 + 64)
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def assert_close_to_reference(out, ref, dtype):
    o = out.double()
    assert not torch.isnan(o).any()
    u = UNIT[dtype]
    rel = float((o - ref).norm() / ref.norm())
    assert rel <= 4 * u, f"relative error {rel:.2e} > {4 * u:.2e}"
    assert float((o - ref).abs().max()) <= 8 * u * float(ref.abs().max())


@pytest.fixture(scope="module", autouse=True)
def registered():
    sb.register()


def test_registered_in_vllm_registry():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum["TRITON_MLA_SPARSE"]
    cls = member.get_class()
    assert cls is sb.TritonMLASparseBackend
    assert cls.is_sparse() and cls.is_mla() and cls.get_name() == "TRITON_MLA_SPARSE"
    sb.register()  # idempotent
    assert AttentionBackendEnum["TRITON_MLA_SPARSE"] is member


@pytest.mark.parametrize("cap", ["12.0", "8.0", "8.6", "9.0", "10.0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "fp8_ds_mla"])
def test_selector_picks_it_when_asked(cap, dtype, kv):
    got = sb.select_backend(cap, dtype=dtype, kv_cache_dtype=kv)
    assert got["reason"] is None, got["reason"]
    assert got["path"] == BACKEND_PATH


@pytest.mark.parametrize("dtype, kv", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_selector_takes_a_named_cache_dtype_equal_to_the_model_dtype(dtype, kv):
    got = sb.select_backend("12.0", dtype=dtype, kv_cache_dtype=kv)
    assert got["reason"] is None and got["path"] == BACKEND_PATH, got


def test_sm120_fp16_without_glm5lab_has_no_backend():
    """The seed's wall, from vLLM's own priority list: nothing serves SM120 + fp16 + sparse MLA."""
    got = sb.select_backend("12.0", dtype=torch.float16, requested=None)
    assert got["backend"] is None
    assert "No valid attention backend" in got["reason"] and "sparse not supported" in got["reason"]


def test_cuda_fallback_makes_vllm_choose_it_only_where_nothing_else_serves():
    import importlib

    sb.cuda_platform_for("12.0")                       # imports vllm.platforms.cuda on a CPU machine
    cuda = importlib.import_module("vllm.platforms.cuda")
    original = cuda._get_backend_priorities
    try:
        sb._apply_cuda_fallback(cuda)
        got = sb.select_backend("12.0", dtype=torch.float16, requested=None)
        assert got["path"] == BACKEND_PATH, got
        # where vLLM's own sparse backend is valid it keeps priority
        got = sb.select_backend("9.0", dtype=torch.bfloat16, requested=None)
        assert got["backend"] == "FlashMLASparseBackend", got
        # non-MLA priorities are untouched
        assert sb.BACKEND_NAME not in [b.name for b in cuda._get_backend_priorities(False, cuda.DeviceCapability(12, 0))]
    finally:
        cuda._get_backend_priorities = original


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dtype=torch.float32), "dtype not supported"),
    (dict(use_sparse=False), "non-sparse not supported"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype not supported"),
    (dict(head_size=512), "head_size not supported"),
    (dict(dtype=torch.bfloat16, kv_cache_dtype="float16"), "a float16 KV cache needs a float16 model"),
    (dict(dtype=torch.float16, kv_cache_dtype="bfloat16"), "a bfloat16 KV cache needs a bfloat16 model"),
])
def test_selector_reports_why_not(kwargs, reason):
    got = sb.select_backend("12.0", **kwargs)
    assert got["backend"] is None and reason in got["reason"]


@pytest.mark.parametrize("nope, ok", [(192, True), (128, True), (64, False)])
def test_geometry(nope, ok):
    from types import SimpleNamespace

    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=nope, index_topk=2048)
    assert (sb.geometry_problem(cfg) is None) == ok
    assert "index_topk" in sb.geometry_problem(SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64,
                                                               qk_nope_head_dim=192))


# ---------------------------------------------------------------------------------------- forward_mqa
def _impl(num_heads, kv_cache_dtype, topk_buffer):
    return sb.TritonMLASparseImpl(
        num_heads=num_heads, head_size=576, scale=GLM5_SCALE, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
        kv_sharing_target_layer_name=None, topk_indices_buffer=topk_buffer, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256)


def _mixed_batch(gen, topk=12, block_size=4, num_blocks=24):
    """Three requests: decode (1 token, context 9), prefill (5 new tokens on an empty cache), chunked
    prefill (3 new tokens after 6 cached). Block tables point at shuffled physical blocks."""
    seq_lens = torch.tensor([9, 5, 9])
    query_lens = torch.tensor([1, 5, 3])
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.stack([perm[0:4], perm[4:8], perm[8:12]]).int()
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    req = torch.repeat_interleave(torch.arange(3), query_lens)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens.tolist(), query_lens.tolist())])
    T = int(query_lens.sum())
    topk_idx = torch.full((T, topk), -1, dtype=torch.int32)
    for t in range(T):
        n = int(positions[t]) + 1
        pick = torch.randperm(n, generator=gen)[: min(n, topk - 3)]
        row = torch.full((topk,), -1, dtype=torch.int32)
        cols = torch.randperm(topk, generator=gen)[: pick.numel()]     # -1 anywhere in the row
        row[cols] = pick.int()
        if t == 1:
            row[cols[-1]] = 31            # beyond its request's length: must be skipped
        topk_idx[t] = row
    md = sb.TritonMLASparseMetadata(
        num_reqs=3, max_query_len=5, max_seq_len=9, num_actual_tokens=T, query_start_loc=qsl.int(),
        seq_lens=seq_lens.int(), slot_mapping=torch.zeros(T, dtype=torch.long), block_table=block_table,
        req_id_per_token=req.int(), query_positions=positions.int(), num_decode_reqs=1, num_prefill_reqs=2,
        block_size=block_size, topk_tokens=topk, num_decodes=3, num_prefills=0, num_decode_tokens=T)
    # Global slots, independently of the code under test.
    slots = torch.full_like(topk_idx, -1, dtype=torch.long)
    for t in range(T):
        for j, p in enumerate(topk_idx[t].tolist()):
            if 0 <= p < int(seq_lens[req[t]]) and p <= int(positions[t]):
                slots[t, j] = int(block_table[req[t], p // block_size]) * block_size + p % block_size
    return md, topk_idx, slots


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads", [3, 8])
def test_forward_mqa_mixed_batch_equals_reference(dtype, num_heads):
    gen = torch.Generator().manual_seed(1000 + num_heads)
    md, topk_idx, slots = _mixed_batch(gen)
    T = topk_idx.shape[0]
    cache = torch.randn(24, 4, 576, generator=gen).to(dtype)
    buffer = torch.full((16, topk_idx.shape[1]), 7, dtype=torch.int32)   # poisoned beyond T
    buffer[:T] = topk_idx
    q_nope = torch.randn(T, num_heads, 512, generator=gen).to(dtype)
    q_pe = torch.randn(T, num_heads, 64, generator=gen).to(dtype)
    impl = _impl(num_heads, "auto", buffer)
    out, lse = impl.forward_mqa((q_nope, q_pe), cache, md, layer=None)
    # tests/conftest.py sets TRITON_INTERPRET=1 without CUDA: this is glm5lab's Triton kernel, not a fallback
    assert impl.last_path == sb.PATH_TRITON
    want, _ = sparse_mla_reference(torch.cat([q_nope, q_pe], -1), cache, slots, GLM5_SCALE)
    assert out.shape == (T, num_heads, 512) and out.dtype == dtype
    assert_close_to_reference(out, want, dtype)
    assert impl.mixed_batches == 1


def test_forward_mqa_fp8_ds_mla_equals_reference_on_dequantized_cache():
    from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla

    gen = torch.Generator().manual_seed(7)
    md, topk_idx, slots = _mixed_batch(gen)
    T = topk_idx.shape[0]
    rows = torch.randn(24 * 4, 576, generator=gen)
    # Written through the backend's own cache writer (the CPU path of do_kv_cache_update).
    cache = torch.zeros(24, 4, 656, dtype=torch.uint8)
    sb.write_mla_cache_torch(rows[:, :512], rows[:, 512:].unsqueeze(1), cache,
                             torch.arange(96), "fp8_ds_mla")
    q = torch.randn(T, 8, 576, generator=gen).to(torch.bfloat16)
    impl = _impl(8, "fp8_ds_mla", topk_idx.clone())
    out, _ = impl.forward_mqa(q, cache, md, layer=None)
    want, _ = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), slots, GLM5_SCALE)
    assert_close_to_reference(out, want, torch.bfloat16)


def test_cache_writer_respects_block_stride_and_skips_padding():
    """vLLM may interleave other layers' pages between this layer's blocks (block stride > block size)."""
    gen = torch.Generator().manual_seed(3)
    backing = torch.zeros(6, 2, 4, 576, dtype=torch.float16)      # 2 layers' pages interleaved
    cache = backing[:, 0]                                           # [6 blocks, 4, 576], stride 2*4*576
    kv_c = torch.randn(5, 512, generator=gen).half()
    k_pe = torch.randn(5, 1, 64, generator=gen).half()
    slot_mapping = torch.tensor([5, 0, -1, 23, 9])
    sb.write_mla_cache_torch(kv_c, k_pe, cache, slot_mapping, "auto")
    for i, s in enumerate(slot_mapping.tolist()):
        if s >= 0:
            assert torch.equal(cache[s // 4, s % 4], torch.cat([kv_c[i], k_pe[i, 0]]))
    assert int((backing[:, 1] != 0).sum()) == 0                    # the other layer untouched
    assert int((cache.reshape(-1, 576).abs().sum(-1) > 0).sum()) == 4
