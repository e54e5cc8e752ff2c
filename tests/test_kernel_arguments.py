"""What the kernels' wrappers do with inputs a caller can plausibly get wrong (a second fresh-eyes audit): a strided
view of a small index or weight tensor gives the contiguous tensor's result, not its neighbours'; a too-narrow cache,
a NaN scale, a wrong-sized `out`, float key windows, a short slot mapping are one-line errors; int64 slots beyond
the cache are skipped even where the int32 cast would wrap them onto real slots. CPU: the Triton interpreter."""
import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.kernels.dsa_indexer import (indexer_logits_decode, indexer_logits_prefill, indexer_topk,
                                         write_index_key_cache)
from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from glm5lab.kernels.paged_mla_decode import paged_mla_decode
from glm5lab.kernels.sparse_mla import sparse_mla_attention
from glm5lab.sparse.reference import sparse_mla_reference
from glm5lab.sparse.virtual_block_table import req_index_to_global_slots, virtual_block_table_attention

SCALE = 0.0625


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a column view of a wider tensor (stride 2 along its last dimension)."""
    wide = torch.stack([t, torch.full_like(t, 7)], dim=-1)
    view = wide[..., 0]
    assert view.stride(-1) == 2 and torch.equal(view, t)
    return view


def _sparse_case(gen, T=2, H=4, slots_in_cache=32):
    q = (torch.randn(T, H, 576, generator=gen) * 1.5).to(torch.bfloat16)
    kv = torch.randn(2, 16, 576, generator=gen).to(torch.bfloat16)
    slots = torch.randint(0, slots_in_cache, (T, 8), generator=gen, dtype=torch.int32)
    return q, kv, slots


def test_a_too_narrow_16bit_cache_is_refused_with_the_default_layout():
    q, kv, slots = _sparse_case(torch.Generator().manual_seed(1))
    for width in (512, 575, 64):
        with pytest.raises(Glm5labError, match=f"needs rows of 576 elements, got {width}"):
            sparse_mla_attention(q, kv[..., :width].contiguous(), slots, SCALE)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), None, "0.1"])
def test_a_scale_that_is_not_a_finite_number_is_refused(scale):
    q, kv, slots = _sparse_case(torch.Generator().manual_seed(2))
    with pytest.raises(Glm5labError, match="softmax_scale must be a finite number"):
        sparse_mla_attention(q, kv, slots, scale)
    with pytest.raises(Glm5labError, match="softmax_scale must be a finite number"):
        virtual_block_table_attention(q, kv, slots, scale)


def test_int64_slots_beyond_int32_are_skipped_not_wrapped_onto_real_slots():
    q, kv, slots = _sparse_case(torch.Generator().manual_seed(3))
    wide = slots.long()
    wide[0, 1] = 2**32 + 3            # the int32 cast alone makes this slot 3
    wide[1, 2] = -(2**32) + 5         # and this one slot 5
    wide[1, 4] = 32                   # just beyond the cache
    ref_slots = wide.clone()
    ref_slots[(ref_slots < 0) | (ref_slots >= 32)] = -1
    out, lse = sparse_mla_attention(q, kv, wide, SCALE)
    ref_out, ref_lse = sparse_mla_reference(q, kv, ref_slots, SCALE)
    # bf16 output rounding (2e-2, as test_paged_mla_decode.TOL); the lse is float32 (2e-5, the sparse kernel test's
    # bound): a wrapped slot would add a real key to the row and move its lse by roughly that key's weight, >> 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


def test_strided_index_and_weight_views_read_as_their_values():
    gen = torch.Generator().manual_seed(4)
    T, H, D, page, blocks = 3, 4, 64, 8, 6
    cache = torch.zeros(blocks, page, D + 4, dtype=torch.uint8)
    write_index_key_cache(cache, torch.randn(blocks * page, D, generator=gen), torch.arange(blocks * page))
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    w = torch.randn(T, H, generator=gen) / H
    bt = torch.stack([torch.randperm(blocks, generator=gen)[:4] for _ in range(T)]).int()
    lens = torch.tensor([30, 11, 25], dtype=torch.int32)
    want = indexer_logits_decode(q, w, cache, bt, lens, max_len=32)
    got = indexer_logits_decode(q, w.t().contiguous().t(), cache, _strided(bt), _strided(lens), max_len=32)
    assert w.t().contiguous().t().stride() != w.stride()
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    keys = torch.randn(40, D, generator=gen)
    amax = keys.abs().amax(dim=1).clamp(min=1e-4)
    values, scales = (keys / (amax / 448)[:, None]).to(torch.float8_e4m3fn), amax / 448
    ks = torch.tensor([0, 5, 12], dtype=torch.int32)
    ke = torch.tensor([20, 40, 33], dtype=torch.int32)
    want = indexer_logits_prefill(q, w, (values, scales), ks, ke)
    got = indexer_logits_prefill(q, w.t().contiguous().t(), (values, _strided(scales)), _strided(ks), _strided(ke))
    torch.testing.assert_close(got, want, atol=0, rtol=0)

    logits = torch.randn(T, 50, generator=gen)
    lengths = torch.tensor([50, 9, 31], dtype=torch.int32)
    for method in ("radix16", "hist", "split"):
        assert torch.equal(indexer_topk(logits, 8, _strided(lengths), method=method),
                           indexer_topk(logits, 8, lengths, method=method)), method


def test_paged_decode_reads_a_strided_seq_lens_as_its_values():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 576, generator=gen).to(torch.bfloat16)
    kv = torch.randn(4, 16, 576, generator=gen).to(torch.bfloat16)
    bt = torch.tensor([[2, 0, 3], [1, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    want = paged_mla_decode(q, kv, bt, lens, SCALE)
    got = paged_mla_decode(q, kv, _strided(bt), _strided(lens), SCALE)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(Glm5labError, match="block_n must be a power of two >= 16, got 24"):
        paged_mla_decode(q, kv, bt, lens, SCALE, block_n=24)
    with pytest.raises(Glm5labError, match="softmax_scale must be a finite number"):
        paged_mla_decode(q, kv, bt, lens, float("nan"))


def test_indexer_arguments_a_kernel_would_misread_are_refused():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 4, generator=gen)
    cache = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    bt = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    with pytest.raises(Glm5labError, match=r"out must be float32 \[2, 20\]"):
        indexer_logits_decode(q, w, cache, bt, lens, out=torch.zeros(2, 5))        # wrote past it before
    with pytest.raises(Glm5labError, match=r"out must be float32 \[2, 20\]"):
        indexer_logits_decode(q, w, cache, bt, lens, out=torch.zeros(2, 20, dtype=torch.float16))
    with pytest.raises(Glm5labError, match="block_n must be a power of two >= 16, got 24"):
        indexer_logits_decode(q, w, cache, bt, lens, block_n=24)
    with pytest.raises(Glm5labError, match="max_len must be >= 0"):
        indexer_logits_decode(q, w, cache, bt, lens, max_len=-1)
    keys = torch.randn(24, 64).to(torch.bfloat16)
    for bad in (torch.tensor([0.0, 2.0]), torch.tensor([0, 2], dtype=torch.int16)):
        with pytest.raises(Glm5labError, match="ks must be int32 or int64"):
            indexer_logits_prefill(q, w, keys, bad, torch.tensor([3, 9]))
    with pytest.raises(Glm5labError, match=r"slot_mapping must be a \[3\] tensor"):
        write_index_key_cache(cache, torch.randn(3, 64), torch.tensor([0, 1]))
    with pytest.raises(Glm5labError, match="slot_mapping must be int32 or int64"):
        write_index_key_cache(cache, torch.randn(2, 64), torch.tensor([0.0, 5.7]))
    for k in (2.0, True, torch.tensor(4)):
        with pytest.raises(Glm5labError, match="k must be a positive int"):
            indexer_topk(torch.randn(2, 50), k)
    with pytest.raises(Glm5labError, match="block must be a power of two >= 16, got 100"):
        indexer_topk(torch.randn(2, 50), 4, block=100)
    # the decode's tiling knobs, each named alone (a bool or a float reached the kernel); the prefill's are in
    # test_indexer_kernels.test_prefill_logits_name_bad_fp8_keys
    for knob, value in (("tiles", 0), ("num_stages", 0), ("num_stages", True), ("tiles", 2.0)):
        with pytest.raises(Glm5labError, match=f"^{knob} must be an integer >= 1, got {value!r}$"):
            indexer_logits_decode(q, w, cache, bt, lens, **{knob: value})


def test_other_argument_types_get_one_line_errors():
    q, kv, slots = _sparse_case(torch.Generator().manual_seed(7))
    with pytest.raises(Glm5labError, match=r"slots must be a \[tokens=2, topk\] tensor, got list"):
        sparse_mla_attention(q, kv, slots.tolist(), SCALE)
    with pytest.raises(Glm5labError, match="kv_cache must be a"):
        sparse_mla_attention(q, None, slots, SCALE)
    with pytest.raises(Glm5labError, match=r"q must be \[tokens, heads, D\]"):
        virtual_block_table_attention(q[0], kv, slots, SCALE)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(Glm5labError, match="seq_lens must be a torch.Tensor, got list"):
        req_index_to_global_slots(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), bt, 16,
                                  seq_lens=[20])
    with pytest.raises(Glm5labError, match="block_stride_rows must be an int"):
        req_index_to_global_slots(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), bt, 16,
                                  block_stride_rows="x")
    cache = quantize_fp8_ds_mla(kv)
    with pytest.raises(Glm5labError, match="dequantizes to a floating-point dtype"):
        dequantize_fp8_ds_mla(cache, torch.int32)
    with pytest.raises(Glm5labError, match="fp8_ds_mla needs rows of 576"):
        quantize_fp8_ds_mla(torch.tensor(1.0))


def test_tensors_a_triton_launch_cannot_take_are_refused_by_name():
    """A `meta` out (or one on another device) would reach Triton as a pointer it cannot read; so would int lengths
    of another device. Each wrapper names the tensors and their devices first."""
    from glm5lab.kernels.dsa_indexer import write_index_key_cache as write_keys

    q, kv, slots = _sparse_case(torch.Generator().manual_seed(6))
    with pytest.raises(Glm5labError, match=r"q, kv_cache, slots, out must be on one device, got .*out on meta"):
        sparse_mla_attention(q, kv, slots, SCALE, out=torch.empty(2, 4, 512, dtype=torch.bfloat16, device="meta"))
    logits = torch.randn(3, 40)
    with pytest.raises(Glm5labError, match=r"logits, lengths must be on one device, got .*lengths on meta"):
        indexer_topk(logits, 4, torch.full((3,), 40, dtype=torch.int32, device="meta"))
    qi, w = torch.randn(2, 3, 64).bfloat16(), torch.randn(2, 3)
    with pytest.raises(Glm5labError, match=r"max_len must be >= 0, got -1"):
        indexer_logits_prefill(qi, w, torch.randn(10, 64).bfloat16(), torch.zeros(2, dtype=torch.int32),
                               torch.full((2,), 10, dtype=torch.int32), max_len=-1)
    with pytest.raises(Glm5labError, match=r"index-key cache must be \[blocks, block_size, width\], got shape"):
        write_keys(torch.zeros(64, dtype=torch.bfloat16), torch.randn(3, 64), torch.tensor([0, 1, 2]))


def test_cpu_tensors_without_the_interpreter_are_one_line_that_says_how():
    """The README's API example on a CPU: Triton's own error is "0 active drivers"; glm5lab says what to set."""
    import subprocess
    import sys

    code = ("import os, torch; os.environ.pop('TRITON_INTERPRET', None)\n"
            "from glm5lab.errors import Glm5labError\n"
            "from glm5lab.kernels.sparse_mla import sparse_mla_attention\n"
            "from glm5lab.kernels.dsa_indexer import indexer_topk\n"
            "q = torch.randn(2, 8, 576).bfloat16(); kv = torch.randn(4, 16, 576).bfloat16()\n"
            "slots = torch.randint(0, 64, (2, 32), dtype=torch.int32)\n"
            "for call in (lambda: sparse_mla_attention(q, kv, slots, 576 ** -0.5),\n"
            "             lambda: indexer_topk(torch.randn(2, 50), 4)):\n"
            "    try:\n"
            "        call()\n"
            "    except Glm5labError as exc:\n"
            "        print('REFUSED', exc)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 2, run.stdout + run.stderr
    assert all("set TRITON_INTERPRET=1 before glm5lab's kernels are imported" in line for line in lines)
