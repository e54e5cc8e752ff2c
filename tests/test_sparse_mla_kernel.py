"""glm5lab's fused sparse-MLA kernel against the float64 reference (sparse_mla_reference).

Tolerances (out: relative Frobenius error and an element-wise bound, both against float64):
- The kernel reads exactly the values the reference reads (fp8_ds_mla: the reference gets the DEQUANTIZED
  cache; fp8 -> fp16/bf16 is exact, the per-128 scale is applied in fp32), accumulates in fp32, and
  rounds twice: the probabilities P to the input dtype before P.V, and the output. Each rounding is at
  most the unit roundoff u (bf16 2^-8, fp16 2^-11 as a relative error). So rel. Frobenius <= 4u
  (bf16 1.6e-2, fp16 2e-3) and every element within 8u * max|ref|; a wrong row or head gives O(1).
  Measured: bf16 ~5e-3, fp16 ~2.5e-4 (CPU interpreter).
- lse is fp32 arithmetic over <= 2048 terms: abs 2e-5 (FlashMLA's own tests use 1e-6 against an fp32
  reference; ours is float64 and sums in a different order, a few fp32 ulps of |lse| ~ 10).
Every run writes into an output poisoned with NaN, so an element the kernel forgets to write fails.
"""
import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st, HealthCheck

from glm5lab.bench.kernel_bench import OTHER_GPU_TILES
from glm5lab.errors import Glm5labError
from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from glm5lab.kernels.host import next_pow2
from glm5lab.kernels.sparse_mla import default_config_for, sparse_mla_attention, stored_column
from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference
from tests.seeds import fresh_seed

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SCALE = mla_softmax_scale()


def make_case(T, H, topk, num_slots, dtype, layout, device, block_size=16, seed=None):
    """Fresh random q / cache / slots with -1 padding scattered through rows, one all-invalid row (when
    T > 1), duplicate slots and a few slots beyond the cache (skipped by the kernel, so the reference
    sees them as -1)."""
    g = torch.Generator(device="cpu").manual_seed(seed if seed is not None else fresh_seed())
    nblocks = -(-num_slots // block_size)
    q = (torch.randn(T, H, 576, generator=g) * 1.5).to(dtype)
    kv = torch.randn(nblocks, block_size, 576, generator=g).to(dtype if layout != "fp8_ds_mla" else torch.bfloat16)
    slots = torch.randint(0, nblocks * block_size, (T, topk), generator=g, dtype=torch.int32)
    slots[torch.rand(T, topk, generator=g) < 0.25] = -1                       # padding anywhere
    if topk >= 4:
        slots[:, 1] = slots[:, 3]                                             # duplicates
        slots[0, 2] = nblocks * block_size + 5                                # beyond the cache: skipped
    if T > 1:
        slots[T // 2] = -1                                                    # all-invalid row
    if layout == "fp8_ds_mla":
        cache = quantize_fp8_ds_mla(kv)
        ref_kv = dequantize_fp8_ds_mla(cache)
    else:
        cache = ref_kv = kv
    ref_slots = slots.clone()
    ref_slots[ref_slots >= nblocks * block_size] = -1
    # the float64 reference runs where the data is (the H200 for the real shapes), then comes to the CPU
    ref = sparse_mla_reference(q.to(device), ref_kv.to(device), ref_slots.to(device), SCALE)
    return q.to(device), cache.to(device), slots.to(device), tuple(x.cpu() for x in ref)


def run_poisoned(q, cache, slots, **kw):
    T, H, _ = q.shape
    out = torch.full((T, H, 512), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=q.device)
    o, l = sparse_mla_attention(q, cache, slots, SCALE, out=out, lse=lse, **kw)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    return o, l


def check(out, lse, ref, dtype, lse_rel=0.0):
    """out within a few units of dtype's rounding of the reference; lse within 2e-5 (plus lse_rel of |lse|: scores of
    hundreds carry float32's relative rounding, ~1e-7 a sum of 576 products)."""
    ref_out, ref_lse = ref
    o = out.double().cpu()
    assert not torch.isnan(o).any(), "unwritten (NaN-poisoned) output elements"
    u = UNIT[dtype]
    rel = float((o - ref_out).norm() / ref_out.norm().clamp(min=1e-30))
    assert rel <= 4 * u, f"relative error {rel:.2e} > {4 * u:.2e}"
    assert float((o - ref_out).abs().max()) <= 8 * u * float(ref_out.abs().max()) + 1e-6
    l = lse.double().cpu()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(l), empty), "empty rows must give lse = -inf, and only they"
    assert bool((o[empty.nonzero(as_tuple=True)] == 0).all()), "empty rows must give out = 0"
    if bool((~empty).any()):
        assert float(((l - ref_lse).abs() - lse_rel * ref_lse.abs())[~empty].max()) <= 2e-5


CASES = [(dt, lay, splits, merge)
         for dt in (torch.bfloat16, torch.float16)
         for lay in ("native", "fp8_ds_mla")
         for splits, merge in ((1, "fused"), (3, "fused"), (3, "separate"))]


@pytest.mark.parametrize("dtype,layout,splits,merge", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-s{c[2]}-{c[3]}" for c in CASES])
def test_matches_reference(device, dtype, layout, splits, merge):
    q, cache, slots, ref = make_case(4, 5, 150, 300, dtype, layout, device)
    lay = "fp8_ds_mla" if layout == "fp8_ds_mla" else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    out, lse = run_poisoned(q, cache, slots, layout=lay, num_splits=splits, merge=merge)
    check(out, lse, ref, dtype)


# OTHER_GPU_TILES: the bf16/fp16 tiles of GPUs this project has none of (NOTES.md v53): ~100 KB of shared memory a
# block (SM86 / SM89 / SM120: 64 heads x 16 rows), SM100/103 (32-head tiles); the same Triton kernel, so it runs here

@pytest.mark.parametrize("gpu", OTHER_GPU_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_gpus_wide_tiles_match_reference(device, gpu, dtype):
    """The > 32-head tile another GPU gets by default (default_config_for its capability) gives the reference's result:
    40 heads (a partly empty 64-head tile), several splits through both merges and one."""
    cfg = default_config_for(40, False, OTHER_GPU_TILES[gpu])
    assert (cfg["block_h"], cfg["block_n"]) == {"sm120": (64, 16), "sm100": (32, 32)}[gpu]
    q, cache, slots, ref = make_case(3, 40, 3 * cfg["block_n"] - 5, 300, dtype, "native", device)
    for splits, merge in ((1, "auto"), (3, "fused"), (3, "separate")):
        out, lse = run_poisoned(q, cache, slots, num_splits=splits, merge=merge, _config={**cfg, "impl": "triton"})
        check(out, lse, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_and_sm100_fp8_32_head_tile_matches_reference(device, dtype):
    """fp8_ds_mla at 17-32 heads on SM90 / SM100 takes the "f16" path on the 32-head tile (v55): 24 heads (a partly
    empty tile), both q dtypes, several splits through both merges and one."""
    for capability in ((9, 0), (10, 0)):
        cfg = default_config_for(24, True, capability)
        assert (cfg["block_h"], cfg["block_n"], cfg["fp8_path"]) == (32, 32, "f16"), capability
    q, cache, slots, ref = make_case(3, 24, 3 * cfg["block_n"] - 5, 300, dtype, "fp8_ds_mla", device)
    for splits, merge in ((1, "auto"), (3, "fused"), (3, "separate")):
        out, lse = run_poisoned(q, cache, slots, layout="fp8_ds_mla", num_splits=splits, merge=merge,
                                _config={**cfg, "impl": "triton"})
        check(out, lse, ref, dtype)


@pytest.mark.parametrize("H,splits", [(40, 37), (12, 37), (3, 64)])
def test_column_merge_many_splits(device, H, splits):
    """The separate (column-parallel) merge with more splits than one load round holds (40 heads -> the wide 16-head
    tile: 37 splits padded to 64, 2 rounds of 32), and its narrow tiles at <= 16 heads (NOTES.md v24: 2 heads a
    program on one warp, every split in one round; 12 heads in six tiles, 3 heads in two, the second half empty);
    one 16-row step a split, a token with no valid slot, fp8 (the latency path)."""
    from glm5lab.kernels.sparse_mla import _merge_columns_kernel, merge_tiles, merge_warps

    mh, dc, sc = merge_tiles(H, splits)
    assert mh * dc * sc <= 8192 and sc <= next_pow2(splits)
    assert (sc < next_pow2(splits)) == (H > 16)                     # two rounds on the wide tile, one on the narrow
    assert merge_warps(_merge_columns_kernel, mh, dc, sc) == (4 if H > 16 else 1)
    q, cache, slots, ref = make_case(2, H, 16 * splits - 5, 700, torch.bfloat16, "fp8_ds_mla", device)
    out, lse = run_poisoned(q, cache, slots, layout="fp8_ds_mla", num_splits=splits, merge="separate",
                            _config={"block_n": 16})
    check(out, lse, ref, torch.bfloat16)


def test_narrow_column_merge_tiles_follow_the_probe():
    """At <= 16 heads the column merge runs 2-head programs of 2048 values a round on one warp (the H200 probe,
    NOTES.md v24: 1.4-1.9 us less than the 16-head tile at 1-8 tokens); 16-column blocks at least (fp16 partials
    are stored in them); beyond 16 heads fp16 partials one head of 2048 values on one warp (v27), fp32 ones the wide
    16-head tile of <= 8192 values on four warps."""
    from glm5lab.kernels import sparse_mla as sm

    for heads in (1, 2, 3, 8, 12, 16):
        for splits in (9, 16, 17, 32, 37, 64, 128):
            mh, dc, sc = sm.merge_tiles(heads, splits)
            assert mh == min(2, next_pow2(heads)) and dc >= 16 and 512 % dc == 0, (heads, splits)
            assert mh * dc * sc <= sm.MERGE_VALUES_PER_WARP
            assert sm.merge_warps(sm._merge_columns_kernel, mh, dc, sc) == 1
    for heads in (17, 64, 128):
        for splits in (17, 32, 64, 128):
            mh, dc, sc = sm.merge_tiles(heads, splits)
            assert mh == 16 and dc >= 16 and mh * dc * sc <= 8192 and sc <= next_pow2(splits)
            assert sm.merge_warps(sm._merge_columns_kernel, mh, dc, sc) == 4
            # fp16 partials (the 64-head kernels'): one head, 2048 values a round, one warp (NOTES.md v27)
            mh, dc, sc = sm.merge_tiles(heads, splits, fp16=True)
            assert (mh, dc) == (1, max(16, min(64, 2048 // next_pow2(splits)))) and dc * sc <= 2048
            assert sc == min(next_pow2(splits), 2048 // dc)
            assert sm.merge_warps(sm._merge_columns_kernel, mh, dc, sc) == 1
            assert sm.merge_plan(heads, splits, True)[1:] == (mh, dc, sc)
    assert sm.merge_tiles(64, 32, fp16=True) == (1, 64, 32)
    assert sm.merge_warps(sm._merge_unrolled_kernel, 8, 64, 4) == 4


def test_merge_plan_unrolls_few_splits_and_loads_many_at_once():
    """The separate merge's kernel follows the H200 probe (NOTES.md v13): unrolled up to 16 splits (8 at <= 16
    heads), the column merge beyond; either tile holds <= 8192 fp32 values a round."""
    from glm5lab.kernels import sparse_mla as sm

    for heads in (1, 3, 8, 16, 17, 64, 128):
        for splits in (2, 3, 4, 8, 9, 16, 17, 32, 64):
            kernel, mh, dc, sc = sm.merge_plan(heads, splits)
            columns = splits > 16 or (splits > 8 and heads <= 16)
            assert kernel is (sm._merge_columns_kernel if columns else sm._merge_unrolled_kernel), (heads, splits)
            assert mh * dc * sc <= 8192 and sc <= next_pow2(splits) and 512 % dc == 0 and mh <= max(next_pow2(heads), 8)
            # fp16 partials: the same kernel, 256 columns a program up to 4 splits (NOTES.md v14 runs 2-3); the
            # column merge beyond 16 heads one head a program (v27)
            k16, mh16, dc16, sc16 = sm.merge_plan(heads, splits, fp16=True)
            assert k16 is kernel and mh16 * dc16 * sc16 <= 8192
            if columns and heads > 16:
                assert mh16 == 1 and dc16 * sc16 == 2048 and sc16 == next_pow2(splits), (heads, splits)
            else:
                assert (mh16, sc16) == (mh, sc) and dc16 == (256 if splits <= 4 else dc), (heads, splits, dc16)


def test_partials_are_fp16_by_default_only_in_the_64_head_gluon_kernels():
    """Which split partials a call writes: fp16 in the 64-head Gluon kernels (both layouts), fp32 in the <= 16-head
    Gluon kernels (they do not take fp16 ones) and in the Triton kernel; _config={"partials": ...} overrides."""
    from glm5lab.kernels import sparse_mla as sm
    from glm5lab.kernels import sparse_mla_sm90 as g

    for heads, fp8 in ((17, True), (64, True), (128, False)):
        assert sm._partials_f16(g.default_config(heads, fp8, 8, 132), gluon=True), (heads, fp8)
        assert not sm._partials_f16({**g.default_config(heads, fp8, 8, 132), "partials": "fp32"}, gluon=True)
        assert not sm._partials_f16(sm.default_config(heads, fp8, torch.device("cpu")), gluon=False)
    for heads, fp8, tokens in ((8, True, 1), (8, True, 64), (16, False, 1), (16, False, 512)):
        assert not sm._partials_f16(g.default_config(heads, fp8, tokens, 132), gluon=True), (heads, fp8, tokens)
    assert sm._partials_f16({**sm.default_config(8, False, torch.device("cpu")), "partials": "fp16"}, gluon=False)


@pytest.mark.parametrize("H,splits", [(3, 1), (20, 3), (8, 5), (64, 9), (12, 13)])
def test_both_merges_match_a_float64_merge_of_random_partials(device, H, splits):
    """Each separate merge kernel on the same random partials (some splits empty: lse -inf; one head empty in every
    split) against the float64 merge; odd head and split counts leave part of a head tile and of a round masked."""
    _check_both_merges(device, 2, H, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,splits", [(1, 8, 64), (8, 64, 16), (32, 64, 4), (16, 128, 4), (7, 33, 9)])
def test_gpu_both_merges_at_real_split_counts(T, H, splits):
    _check_both_merges("cuda", T, H, splits)


def _random_partials(T, H, splits, dtype=torch.float32):
    """Random partials [T, splits, H, 512] and their log2-sum-exp [T, splits, H] (a whole split of the first token
    and the last head of the last token empty: lse -inf), and the generator for anything else the case draws."""
    g = torch.Generator().manual_seed(fresh_seed())
    part_o = torch.randn(T, splits, H, 512, generator=g, dtype=dtype)
    part_lse = torch.randn(T, splits, H, generator=g, dtype=dtype) * 4
    part_lse[0, splits // 2] = float("-inf")
    part_lse[T - 1, :, H - 1] = float("-inf")
    return part_o, part_lse, g


def _float64_merge(part_o, part_lse):
    """(out, lse) of the partials merged in float64 (their lse is log2-sum-exp, the merged lse natural log)."""
    from glm5lab.kernels.paged_mla_decode import merge_partials

    return merge_partials(part_o.double().transpose(1, 2), part_lse.double().transpose(1, 2) * math.log(2))


def _each_merge(part_o, part_lse, device):
    """Both separate merge kernels over the same partials (part_lse: [2, ...] planes for fp16 ones), each into a
    NaN-poisoned out / lse: yields (kernel name, out, lse) as float64 on the CPU."""
    from glm5lab.kernels import sparse_mla as sm

    T, splits, H, _ = part_o.shape
    fp16 = part_o.dtype == torch.float16        # (the unrolled merge's fp16 tile: 256 columns at <= 4 splits)
    for kernel, (mh, dc, sc) in ((sm._merge_columns_kernel, sm.merge_tiles(H, splits, fp16)),
                                 (sm._merge_unrolled_kernel, sm.merge_plan(max(H, 32), min(splits, 16), fp16)[1:])):
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((T, H), float("nan"), device=device)
        sm.launch_merge(kernel, mh, dc, sc, part_o.to(device), part_lse.to(device), out, lse)
        yield kernel.fn.__name__, out.double().cpu(), lse.double().cpu()


def _check_merged_lse(lse, want_lse, name):
    assert torch.equal(lse.isinf(), want_lse.isinf()), name
    torch.testing.assert_close(lse[~want_lse.isinf()], want_lse[~want_lse.isinf()], atol=1e-5, rtol=1e-5)


def _check_both_merges(device, T, H, splits):
    part_o, part_lse, _ = _random_partials(T, H, splits)
    want_o, want_lse = _float64_merge(part_o, part_lse)
    for name, out, lse in _each_merge(part_o, part_lse, device):
        torch.testing.assert_close(out, want_o, atol=2e-2, rtol=1e-2, msg=name)
        _check_merged_lse(lse, want_lse, name)
    assert (want_o[T - 1, H - 1] == 0).all()


# fp16 partials store true column 16 b + 8 g + 2 q + e at 16 b + 4 q + 2 g + e: STORED_ORDER[c'] = the true column
# stored at c' (the (g, q) axes of each 16-column block swapped)
STORED_ORDER = torch.arange(512).view(32, 2, 4, 2).permute(0, 2, 1, 3).reshape(512)


def fp16_partials(part_o):
    """The fp16 partials format, written independently of the kernels: each head's 512 values times the power of
    two that puts their largest magnitude into [2^14, 2^15), in stored-column order, and that power's inverse."""
    amax = part_o.abs().amax(-1)
    mul = torch.where(amax > 0, torch.exp2(14 - torch.floor(torch.log2(amax.clamp(min=1e-30)))), 1.0)
    return (part_o * mul[..., None])[..., STORED_ORDER].half(), 1.0 / mul


def test_stored_column_order_is_the_blocks_axes_swapped():
    """sparse_mla.stored_column (the Triton kernel's index map; the Gluon kernels and the merges permute registers
    instead) against the torch permutation above: its inverse, 16-column blocks kept, not the identity."""
    @triton.jit
    def maps(OUT):
        c = tl.arange(0, 512)
        tl.store(OUT + c, stored_column(c))

    out = torch.empty(512, dtype=torch.int32)
    maps[(1,)](out)
    stored = out.long()
    assert torch.equal(stored[STORED_ORDER], torch.arange(512)) and torch.equal(STORED_ORDER[stored], torch.arange(512))
    assert torch.equal(stored // 16, torch.arange(512) // 16) and not torch.equal(stored, torch.arange(512))


@pytest.mark.parametrize("H,splits", [(3, 2), (20, 3), (64, 9), (12, 13), (5, 33)])
def test_both_merges_read_fp16_partials_with_their_scales(device, H, splits):
    """fp16 partials (_config={"partials": "fp16"}): each head's partial of a random magnitude 1e-4 .. 1e6 (beyond
    fp16's range: a merge that drops the scale gives inf or garbage), stored in the fp16 format with its scale in
    part_lse's second plane; both merges against the float64 merge of the fp32 partials. Bound: a stored value
    is off by at most 2^-11 of its head's largest (half an fp16 ulp at [2^14, 2^15)), the bf16 output by one ulp of
    itself (2^-7: the interpreter truncates, GPUs round to nearest) -- so |out - want| <= 2^-11 * (largest partial
    value of the head) + 2^-7 * |want|. A zero partial (scale 1) and empty splits / heads are in it."""
    from glm5lab.kernels import sparse_mla as sm

    T = 2
    stored, planes = _check_fp16_merges(device, T, H, splits)
    out, lse = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device), torch.empty(T, H, device=device)
    with pytest.raises(Glm5labError, match="need part_lse of shape"):
        sm.launch_merge(sm._merge_unrolled_kernel, 8, 64, 4, stored.to(device), planes[0].to(device), out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,splits", [(1, 64, 32), (4, 64, 32), (2, 128, 32), (3, 40, 128), (8, 64, 16),
                                        (32, 64, 4), (64, 128, 2), (7, 33, 9)])
def test_gpu_both_merges_read_fp16_partials_at_real_split_counts(T, H, splits):
    """The fp16-partials merge at the split counts the 64-head kernels use (tiles, rounds and the in-register column
    reordering as compiled for the GPU, not the interpreter), same bound as the CPU test."""
    _check_fp16_merges("cuda", T, H, splits)


def _check_fp16_merges(device, T, H, splits):
    """Both merges of random fp16 partials (magnitudes 1e-4 .. 1e6) against the float64 merge (bound: see
    test_both_merges_read_fp16_partials_with_their_scales); returns the stored partials and their planes."""
    part_o, part_lse, g = _random_partials(T, H, splits, torch.float64)
    part_o *= 10.0 ** (torch.rand(T, splits, H, 1, generator=g, dtype=torch.float64) * 10 - 4)
    part_o[T - 1, -1, 0] *= 1e6 / part_o[T - 1, -1, 0].abs().max()     # beyond fp16, in a split that counts
    part_o[T - 1, 0, 0] = 0.0
    want_o, want_lse = _float64_merge(part_o, part_lse)
    bound = 2.0**-11 * part_o.abs().amax(dim=(1, 3))[..., None] + 2.0**-7 * want_o.abs()
    stored, scale = fp16_partials(part_o)
    assert torch.isinf(part_o.half()).any()           # the case needs the scale
    planes = torch.stack([part_lse, scale]).float()
    for name, out, lse in _each_merge(stored, planes, device):
        err = (out - want_o).abs()
        assert bool((err <= bound).all()), f"{name}: worst error / bound {float((err / bound).max()):.2f}"
        _check_merged_lse(lse, want_lse, name)
    return stored, planes


@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "native"), (torch.float16, "native"),
                                          (torch.bfloat16, "fp8_ds_mla")], ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("splits", [2, 5])
def test_fp16_partials_match_reference(device, dtype, layout, splits):
    """The Triton kernel writing fp16 partials (each head scaled into [2^14, 2^15) with the scale beside its lse)
    and the separate merge reading them: the usual tolerances hold (the fp16 partial adds at most 2^-12 of a
    head's largest value, below the output's own rounding)."""
    q, cache, slots, ref = make_case(3, 5, 150, 300, dtype, layout, device)
    lay = "fp8_ds_mla" if layout == "fp8_ds_mla" else {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    out, lse = run_poisoned(q, cache, slots, layout=lay, num_splits=splits,
                            _config={"impl": "triton", "partials": "fp16"})
    check(out, lse, ref, dtype)


def test_fp16_partials_keep_values_beyond_fp16_range(device):
    """A bf16 cache whose values reach 1e6 (fp16's largest is 65504; q scaled down as much, so the scores and lse
    stay as in every other case): the scaled fp16 partials still give the reference's output; the fp32 partials, as
    a control, too."""
    q, cache, slots, _ = make_case(2, 3, 64, 128, torch.bfloat16, "native", device)
    q, cache = q * 1e-6, cache * 1e6
    ref = tuple(x.cpu() for x in sparse_mla_reference(q, cache, torch.where(slots >= 128, -1, slots), SCALE))
    assert float(ref[0].abs().max()) > 65504
    for partials in ("fp16", "fp32"):
        out, lse = run_poisoned(q, cache, slots, num_splits=4, merge="separate",
                                _config={"impl": "triton", "partials": partials, "block_n": 16})   # 4 splits
        check(out, lse, ref, torch.bfloat16)


def test_fp16_partials_refusals(device):
    """fp16 partials with the fused merge, an unknown partials form, a Gluon kernel that does not write them:
    each a clear error before any launch."""
    from glm5lab.kernels import sparse_mla_sm90

    q, cache, slots, _ = make_case(1, 4, 32, 64, torch.bfloat16, "native", device)
    with pytest.raises(Glm5labError, match="fp16 partials need the separate merge"):
        sparse_mla_attention(q, cache, slots, SCALE, num_splits=2, merge="fused",
                             _config={"impl": "triton", "partials": "fp16"})
    with pytest.raises(Glm5labError, match="partials must be 'fp32' or 'fp16', got 'bf16'"):
        sparse_mla_attention(q, cache, slots, SCALE, num_splits=2, _config={"impl": "triton", "partials": "bf16"})
    rows = sparse_mla_sm90.default_config(8, True, 64, 132)       # the fp8 rows-as-M kernel
    with pytest.raises(Glm5labError, match="only the 64-head Gluon kernels write them"):
        sparse_mla_sm90.launch((1, 1, 2), (), rows, True, True, part_f16=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 3), H=st.sampled_from([1, 3, 8, 16, 17, 33]), topk=st.integers(1, 140),
       fp8=st.booleans(), bf16=st.booleans(), splits=st.sampled_from([None, 1, 2, 5]),
       block_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(device, T, H, topk, fp8, bf16, splits, block_size, seed):
    dtype = torch.bfloat16 if bf16 else torch.float16
    q, cache, slots, ref = make_case(T, H, topk, 200, dtype, "fp8_ds_mla" if fp8 else "native", device,
                                     block_size=block_size, seed=seed)
    out, lse = run_poisoned(q, cache, slots, num_splits=splits)
    check(out, lse, ref, dtype)


def test_128_heads_two_tiles_and_flat_cache(device):
    """128 heads run as two 64-head tiles; a [slots, 576] cache equals its paged view."""
    q, cache, slots, ref = make_case(2, 128, 40, 100, torch.bfloat16, "native", device)
    out, lse = run_poisoned(q, cache.reshape(-1, 576), slots)
    check(out, lse, ref, torch.bfloat16)


def _raw_fp8_case(device, T=3, H=8, topk=96, num_slots=128):
    """fp8_ds_mla cache of RANDOM BYTES (every e4m3 pattern but NaN: subnormals, +-448, -0), random scales:
    checks the in-kernel fp8 -> bf16/fp16 conversion on values quantization rarely produces."""
    g = torch.Generator().manual_seed(fresh_seed())
    cache = torch.randint(0, 256, (num_slots, 656), generator=g, dtype=torch.uint8)
    nan = (cache[:, :512] & 0x7F) == 0x7F
    cache[:, :512][nan] = 0x3C
    cache[:, 512:528] = (torch.rand(num_slots, 4, generator=g) * 0.05 + 1e-3).contiguous().view(torch.uint8)
    cache[:, 528:] = torch.randn(num_slots, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    slots = torch.randint(0, num_slots, (T, topk), generator=g, dtype=torch.int32)
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), slots, SCALE)
    return q.to(device), cache.reshape(-1, 16, 656).to(device), slots.to(device), ref


def test_fp8_every_byte_pattern(device):
    q, cache, slots, ref = _raw_fp8_case(device)
    out, lse = run_poisoned(q, cache, slots)
    check(out, lse, ref, torch.bfloat16)


# ------------------------------------------------- private fp8 code paths (NOTES.md v4, issue 7 follow-up)

FP8_PATHS_TESTED = ("reload", "reload_words", "f16", "f16_reload")
FP8_PATH_CASES = [(path, dt, splits, merge) for path in FP8_PATHS_TESTED
                  for dt, splits, merge in ((torch.bfloat16, 1, "fused"), (torch.float16, 3, "fused"),
                                            (torch.bfloat16, 3, "separate"))]


@pytest.mark.parametrize("path,dtype,splits,merge", FP8_PATH_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-s{c[2]}-{c[3]}" for c in FP8_PATH_CASES])
def test_fp8_path_matches_reference(device, path, dtype, splits, merge):
    """The private fp8 paths (NOTES.md v4) under the default path's tolerances, both q dtypes and merges."""
    q, cache, slots, ref = make_case(4, 5, 150, 300, dtype, "fp8_ds_mla", device)
    out, lse = run_poisoned(q, cache, slots, layout="fp8_ds_mla", num_splits=splits, merge=merge,
                            _config={"fp8_path": path})
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("path", FP8_PATHS_TESTED)
def test_fp8_path_every_byte_pattern(device, path):
    """Every e4m3 byte pattern; for reload_words also the byte order inside each int32 word (a swapped
    pair of bytes gives O(1) errors here -- the failure of v3's packed conversion)."""
    q, cache, slots, ref = _raw_fp8_case(device)
    out, lse = run_poisoned(q, cache, slots, _config={"fp8_path": path})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.parametrize("path", ["f16", "reload"])
@pytest.mark.parametrize("q_mag,scale_range", [(3e4, (1e-8, 1e-6)), (1e-6, (1e2, 1e4))],
                         ids=["q-beyond-fp16-tiny-scales", "q-below-fp16-normals-large-scales"])
def test_fp8_path_q_and_scale_ranges(device, path, q_mag, scale_range):
    """The "f16" path computes in fp16 whatever q's dtype: q values beyond fp16's range (|q| up to ~1e5 >
    65504) or below its normals (~1e-6 < 6.1e-5), and chunk scales spanning 100x at 1e-8 or 1e2, must
    give the bf16 reference's accuracy -- a missing power-of-two scaling of q overflows to inf or loses
    the small values; a missing normalization of p * scale loses small scales to fp16 subnormals."""
    g = torch.Generator().manual_seed(fresh_seed())
    num_slots, T, H, topk = 128, 3, 8, 96
    cache = torch.randint(0, 256, (num_slots, 656), generator=g, dtype=torch.uint8)
    cache[:, :512][(cache[:, :512] & 0x7F) == 0x7F] = 0x3C                      # no NaN patterns
    lo, hi = math.log(scale_range[0]), math.log(scale_range[1])
    scales = torch.exp(lo + (hi - lo) * torch.rand(num_slots, 4, generator=g))
    cache[:, 512:528] = scales.contiguous().view(torch.uint8)
    cache[:, 528:] = (torch.randn(num_slots, 64, generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    q = (torch.randn(T, H, 576, generator=g) * q_mag).to(torch.bfloat16)
    q[..., 512:] = torch.randn(T, H, 64, generator=g).to(torch.bfloat16)         # rope part: ordinary size
    slots = torch.randint(0, num_slots, (T, topk), generator=g, dtype=torch.int32)
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), slots, SCALE)
    out, lse = run_poisoned(q.to(device), cache.reshape(-1, 16, 656).to(device), slots.to(device),
                            _config={"fp8_path": path})
    check(out, lse, ref, torch.bfloat16)


def test_fp8_paths_unknown_and_diagnostics_need_the_private_flag():
    q = torch.randn(1, 4, 576).bfloat16()
    cache = quantize_fp8_ds_mla(torch.randn(2, 16, 576))
    slots = torch.zeros(1, 3, dtype=torch.int32)
    for path in ("nope", "_diag_reload_no_scales", "_diag_reload_no_convert"):
        with pytest.raises(Glm5labError, match="unknown fp8 path"):
            sparse_mla_attention(q, cache, slots, SCALE, _config={"fp8_path": path})


@pytest.mark.parametrize("path", ["_diag_reload_no_scales", "_diag_reload_no_convert"])
def test_fp8_diagnostic_paths_run_and_write_every_element(device, path):
    """Timing diagnostics give wrong values by design; they must still compile, run and write every output
    element (finite), and the no-scales one must differ from the real result (it skips the scales)."""
    q, cache, slots, ref = make_case(2, 8, 70, 128, torch.bfloat16, "fp8_ds_mla", device)
    out, lse = run_poisoned(q, cache, slots, layout="fp8_ds_mla", _config={"fp8_path": path, "_diagnostic": True})
    assert bool(torch.isfinite(out).all()) and not bool(torch.isnan(lse).any())
    assert float((out.double().cpu() - ref[0]).norm() / ref[0].norm()) > 0.1


def test_empty_topk_and_no_tokens(device):
    q = torch.randn(2, 8, 576, device=device).to(torch.bfloat16)
    cache = torch.randn(4, 16, 576, device=device).to(torch.bfloat16)
    out, lse = run_poisoned(q, cache, torch.empty(2, 0, dtype=torch.int32, device=device))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    out, lse = sparse_mla_attention(q[:0], cache, torch.empty(0, 5, dtype=torch.int32, device=device), SCALE)
    assert out.shape == (0, 8, 512) and lse.shape == (0, 8)


def test_int64_slots_and_noncontiguous_q(device):
    q, cache, slots, ref = make_case(2, 4, 30, 64, torch.float16, "native", device)
    wide = torch.randn(2, 4, 600, device=device).to(torch.float16)
    wide[..., :576] = q
    out, lse = run_poisoned(wide[..., :576], cache, slots.long())
    check(out, lse, ref, torch.float16)


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(2, 4, 576)), "float16 or bfloat16"),
    (dict(q=torch.randn(2, 4, 512).half()), "576"),
    (dict(q=torch.randn(2, 129, 576).half()), "1..128"),
    (dict(q=torch.randn(2, 4, 576).bfloat16()), "same dtype"),
    (dict(slots=torch.zeros(3, 5, dtype=torch.int32)), "slots must be"),
    (dict(slots=torch.zeros(2, 5, dtype=torch.float32)), "int32"),
    (dict(layout="fp8_ds_mla"), "uint8"),
    (dict(layout="nope"), "unknown KV layout"),
    (dict(kv_cache=torch.zeros(4, 16, 600, dtype=torch.uint8)), "infer"),
    (dict(kv_lora_rank=448), "512"),
])
def test_bad_inputs_are_clear_errors(bad, match):
    args = dict(q=torch.randn(2, 4, 576).half(), kv_cache=torch.randn(4, 16, 576).half(),
                slots=torch.zeros(2, 5, dtype=torch.int32), layout="auto", kv_lora_rank=512)
    args.update(bad)
    with pytest.raises(Glm5labError, match=match):
        sparse_mla_attention(args["q"], args["kv_cache"], args["slots"], SCALE, layout=args["layout"],
                             kv_lora_rank=args["kv_lora_rank"])


# ------------------------------------------------------------------------------- H200: real shapes

@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 24, 32, 64, 128])
@pytest.mark.parametrize("T", [1, 8, 37, 130])
@pytest.mark.parametrize("layout", ["native", "fp8_ds_mla"])
def test_gpu_real_shapes(H, T, layout):
    """Top-k 2048 over a 65,536-slot cache (block 64), bf16 q; default splits, fused and separate merge. The Triton
    kernel by name (on sm_90 the default is a Gluon kernel: tests/test_sparse_mla_sm90.py) at its default tile for
    this GPU (fp8 at 24-32 heads: the "f16" path on SM90/SM100)."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, layout, "cuda", block_size=64)
    for merge in ("fused", "separate"):
        out, lse = run_poisoned(q, cache, slots, merge=merge, _config={"impl": "triton"})
        check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu", OTHER_GPU_TILES)
@pytest.mark.parametrize("H,T", [(64, 1), (64, 37), (128, 8), (40, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_other_gpus_wide_tiles_real_shapes(gpu, H, T, dtype):
    """The > 32-head bf16/fp16 tiles of SM86/89/120 and SM100/103 built and run on this GPU at real shapes (top-k 2048,
    65,536 slots, default splits, both merges): what those GPUs would run, checked on the only GPU here."""
    cfg = default_config_for(H, False, OTHER_GPU_TILES[gpu])
    q, cache, slots, ref = make_case(T, H, 2048, 65536, dtype, "native", "cuda", block_size=64)
    for merge in ("fused", "separate"):
        out, lse = run_poisoned(q, cache, slots, merge=merge, _config={**cfg, "impl": "triton"})
        check(out, lse, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("impl,H,T,splits,layout", [
    (impl, *case) for impl in ("triton", "gluon")
    for case in [(8, 1, 64, "fp8_ds_mla"), (64, 8, 16, "fp8_ds_mla"), (64, 32, 4, "fp8_ds_mla"),
                 (8, 8, 16, "fp8_ds_mla"), (16, 2, 32, "native")]] + [
    ("gluon", 8, 1, None, "fp8_ds_mla"), ("gluon", 8, 1, None, "native"), ("gluon", 16, 8, None, "fp8_ds_mla")])
def test_gpu_early_launched_merge_matches_reference(impl, H, T, splits, layout):
    """_config={"pdl": True}: the separate merge launched early (programmatic dependent launch; it waits for the
    attention grid in-kernel) gives the reference's result -- the column merge (64 splits) and the unrolled one
    (16, 4 splits), after the Triton and the Gluon kernels; the Gluon small-batch kernels (mma.sync, rows-as-M, both
    layouts, the default splits too) also let the merge launch from their start (`_let_merge_launch`), so its
    programs wait while the attention still runs."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, layout, "cuda", block_size=64)
    if impl == "gluon" and H > 16:
        from tests.test_sparse_mla_sm90 import _bf16_dequantized_ref
        ref = _bf16_dequantized_ref(q, cache, slots)
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, merge="separate",
                            _config={"impl": impl, "pdl": True, **({"block_n": 32} if splits == 64 else {})})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fp8_every_byte_pattern():
    """Every e4m3 byte pattern through the compiled fp8 -> bf16 path at a real top-k. (A PTX conversion
    tried in v3 failed exactly this test; NOTES.md.)"""
    q, cache, slots, ref = _raw_fp8_case("cuda", T=5, H=16, topk=512, num_slots=4096)
    out, lse = run_poisoned(q, cache, slots)
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fused_merge_is_repeatable_and_resets_counters():
    """The fused merge's counters must come back to zero: many launches in a row give identical bits."""
    q, cache, slots, ref = make_case(3, 8, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    first, first_lse = run_poisoned(q, cache, slots, num_splits=16, merge="fused")
    for _ in range(20):
        out, lse = run_poisoned(q, cache, slots, num_splits=16, merge="fused")
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    check(first, first_lse, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fp16_and_topk_512_1024(dtype):
    for topk in (512, 1024):
        q, cache, slots, ref = make_case(5, 16, topk, 65536, dtype, "native", "cuda", block_size=64)
        out, lse = run_poisoned(q, cache, slots)
        check(out, lse, ref, dtype)
        q, cache, slots, ref = make_case(5, 16, topk, 65536, dtype, "fp8_ds_mla", "cuda", block_size=64)
        out, lse = run_poisoned(q, cache, slots)
        check(out, lse, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("path", FP8_PATHS_TESTED)
@pytest.mark.parametrize("H", [8, 16, 32, 64])
@pytest.mark.parametrize("T", [1, 130])
def test_gpu_fp8_path_real_shapes(path, H, T):
    """The private fp8 paths at real shapes (top-k 2048, 65,536 slots), default splits, fused merge. Same
    values as the default path, so the two must also agree within the element bound."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots, _config={"fp8_path": path})
    check(out, lse, ref, torch.bfloat16)
    base, base_lse = run_poisoned(q, cache, slots, _config={"impl": "triton"})
    assert float((out.float() - base.float()).abs().max()) <= 8 * UNIT[torch.bfloat16] * float(base.float().abs().max())


@pytest.mark.gpu
def test_gpu_fp8_paths_every_byte_pattern_and_8_warps():
    """Every e4m3 byte through the compiled paths, with the 4-warp default tile and the 8-warp one the
    benchmark also times."""
    q, cache, slots, ref = _raw_fp8_case("cuda", T=5, H=16, topk=512, num_slots=4096)
    for path in FP8_PATHS_TESTED:
        for cfg in ({"fp8_path": path}, {"fp8_path": path, "num_warps": 8}):
            out, lse = run_poisoned(q, cache, slots, _config=cfg)
            check(out, lse, ref, torch.bfloat16)


def test_split_choice_fills_the_program_slots_one_step_a_split_at_least():
    from glm5lab.kernels.sparse_mla import choose_num_splits, resident_ctas

    assert resident_ctas(16) == resident_ctas(32) == 2 and resident_ctas(64) == 1
    assert choose_num_splits(512, 1, 2048, 64, 132) == 1                # enough programs already
    assert choose_num_splits(150, 1, 2048, 32, 132) == 1                # over half of the 264 slots: no split
    assert choose_num_splits(128, 1, 2048, 32, 132) == 2                # 264 // 128
    assert choose_num_splits(1, 1, 2048, 32, 132) == 64                 # capped at one 32-row step a split
    assert choose_num_splits(1, 1, 2048, 64, 132) == 32
    assert choose_num_splits(8, 1, 2048, 32, 132) == 33                 # 264 // 8 (rounded up to 32 rows later)
    assert choose_num_splits(8, 1, 2048, 64, 132, resident=1) == 16     # 64-head tile: one CTA a SM
    assert choose_num_splits(1, 2, 2048, 64, 132, resident=1) == 32     # 128 heads = two tiles
    assert choose_num_splits(4, 1, 100, 64, 132) == 1                   # short top-k: no split


def test_auto_merge_is_fused_for_few_splits_and_columns_for_many(device):
    """merge="auto" (the default) gives the bits of merge="fused" up to FUSED_MERGE_MAX_SPLITS splits and of
    merge="separate" beyond; the two merges differ only in summation order."""
    from glm5lab.kernels.sparse_mla import FUSED_MERGE_MAX_SPLITS

    q, cache, slots, ref = make_case(2, 8, 160, 300, torch.float16, "fp16", device)
    for splits, same in ((FUSED_MERGE_MAX_SPLITS, "fused"), (FUSED_MERGE_MAX_SPLITS + 1, "separate")):
        o_auto, l_auto = run_poisoned(q, cache, slots, num_splits=splits, _config={"block_n": 16})
        o_same, l_same = run_poisoned(q, cache, slots, num_splits=splits, merge=same, _config={"block_n": 16})
        assert torch.equal(o_auto, o_same) and torch.equal(l_auto, l_same), (splits, same)
        check(o_auto, l_auto, ref, torch.float16)
    with pytest.raises(Glm5labError, match="merge must be"):
        sparse_mla_attention(q, cache, slots, SCALE, merge="serial")


def test_unevenly_strided_cache_is_a_clear_error():
    big = torch.randn(4, 32, 576).half()
    with pytest.raises(Glm5labError, match="evenly strided"):
        sparse_mla_attention(torch.randn(1, 2, 576).half(), big[:, :16], torch.zeros(1, 3, dtype=torch.int32), SCALE)


def test_kernel_bench_fp8_v4_option_adds_the_paths_only_where_asked(tmp_path, monkeypatch):
    """The benchmark's --fp8-v4 hook (NOTES.md v4): only at FP8_V4_SHAPES, the diagnostics only at H8 T512,
    and the real paths meet the bf16 error bound on the CPU profile (tiny shapes under the interpreter)."""
    from glm5lab.bench import kernel_bench

    assert kernel_bench.fp8_v4_variants(8, 1) == [] and kernel_bench.fp8_v4_variants(128, 512) == []
    assert [n for n, _ in kernel_bench.fp8_v4_variants(64, 512)] == ["glm5lab-fp8-v4-reload"]
    assert sum("diag" in n for n, _ in kernel_bench.fp8_v4_variants(8, 512)) == 2
    assert all("diag" not in n for n, _ in kernel_bench.fp8_v4_variants(8, 128))
    monkeypatch.setattr(kernel_bench, "FP8_V4_SHAPES", {(8, 1)})
    df = kernel_bench.run(tmp_path / "bench.csv", "cpu", heads=(8,), tokens=(1,), verbose=False, fp8_v4=True)
    v4 = df[df.impl.str.startswith("glm5lab-fp8-v4")]
    assert set(v4.impl) == {"glm5lab-fp8-v4-reload", "glm5lab-fp8-v4-words-w8"} and set(v4.layout) == {"fp8_ds_mla"}
    assert (v4.rel_err < 1.6e-2).all()


def test_kernel_bench_v5_option_times_its_variants_beside_the_default(tmp_path, monkeypatch):
    """The benchmark's --v5 hook (NOTES.md v5): variants only at V5_SHAPES, each with its tile spelled out
    (a later change of the defaults must not change what a name measures), all within the bf16 error bound
    on the CPU profile, and --skip drops implementations by name."""
    from glm5lab.bench import kernel_bench

    assert kernel_bench.v5_variants(8, 32) == [] and kernel_bench.v5_variants(128, 512) == []
    for H, T in kernel_bench.V5_SHAPES:
        for name, layout, kw in kernel_bench.v5_variants(H, T):
            assert name.startswith("glm5lab-v5-") and layout in ("bf16", "fp8_ds_mla")
            assert "num_splits" in kw or {"block_h", "block_n", "num_warps"} <= set(kw["_config"]), name
    monkeypatch.setattr(kernel_bench, "V5_SHAPES", {(8, 1)})
    df = kernel_bench.run(tmp_path / "bench.csv", "cpu", heads=(8,), tokens=(1,), verbose=False, v5=True,
                          skip=("torch-gather", "virtual-block-table"))
    v5 = df[df.impl.str.startswith("glm5lab-v5")]
    assert set(v5.impl) == {n for n, _, _ in kernel_bench.v5_variants(8, 1)}
    assert (v5.rel_err < 1.6e-2).all()
    assert not df.impl.isin(["torch-gather", "virtual-block-table"]).any()


def test_latency_anatomy_needs_a_gpu_and_says_so():
    from glm5lab.bench import latency_anatomy

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the anatomy runs (see the gpu test)")
    with pytest.raises(Glm5labError, match="needs a GPU"):
        latency_anatomy.run("unused.csv", verbose=False)


def test_small_batch_sweep_times_only_the_split_counts_asked_for():
    from glm5lab.bench import latency_anatomy

    assert latency_anatomy.sweep_cases("bf16", splits=[0, 2, 4]) == [(None, "auto", None), (2, "auto", None),
                                                                      (4, "auto", None)]
    assert len(latency_anatomy.sweep_cases("fp8_ds_mla")) == 12    # without splits: the v6 sweep


def test_merge_timeline_pairs_each_attention_grid_with_the_merge_after_it():
    """latency_anatomy.timeline_parts: a call is an attention kernel followed by a merge kernel, in start order
    whatever order the profiler lists them; an early-launched merge starts before the attention ends (a negative
    tail is impossible, a start inside the attention is the point); medians over the calls; {} without a merge."""
    from glm5lab.bench import latency_anatomy

    events = [(10.0, 14.5, "_merge_columns_kernel"), (0.0, 5.0, "_sparse_mla_fp8_sm90_kernel"),
              (2.0, 6.0, "_merge_columns_kernel"), (8.0, 13.0, "_sparse_mla_fp8_sm90_kernel"),
              (20.0, 26.0, "_sparse_mla_fp8_sm90_kernel"), (21.0, 28.0, "_merge_columns_kernel")]
    parts = latency_anatomy.timeline_parts(events)
    assert parts == {"attention_us": 5.0, "merge_us": 4.5, "merge_start_after_attention_start_us": 2.0,
                     "merge_end_after_attention_end_us": 1.5, "call_us": 6.5}
    assert latency_anatomy.timeline_parts([(0.0, 5.0, "_sparse_mla_fwd_kernel")]) == {}


@pytest.mark.gpu
def test_gpu_merge_timeline_places_the_early_merge_inside_the_attention(tmp_path):
    """8 heads fp8 x 1 token, the merge in stream order and launched early: five medians each; in stream order the
    merge starts after the attention has ended, launched early it starts before."""
    from glm5lab.bench import latency_anatomy

    rows = latency_anatomy.merge_timeline(tmp_path / "t.csv", verbose=False, tokens=(1,), heads=(8,))
    got = {(r["layout"], "pdlTrue" in r["shape"], r["metric"]): r["value"] for r in rows}
    assert len(rows) == 2 * 2 * 5
    for lay in ("bf16", "fp8_ds_mla"):
        assert got[(lay, False, "merge_start_after_attention_start_us")] >= got[(lay, False, "attention_us")]
        assert got[(lay, True, "merge_start_after_attention_start_us")] < got[(lay, True, "attention_us")]


def _stamped_program(gt_start, clock_start, gt_end):
    """One program's stamps as the kernel writes them: globaltimer at 0 and 13, clock64 at 1-12 (100 a phase)."""
    row = [gt_start, clock_start] + [clock_start + 100 * k for k in range(2, 12)] + [clock_start + 2000, gt_end]
    return row + [-1, -1]


def test_phase_parts_places_the_stamps_on_one_time_axis():
    """latency_anatomy.phase_parts: the clock converts to ns by the programs' globaltimer span over their clock span
    (here 1000 ns over 2000 clocks); phases are medians from each program's start, program starts and ends and the
    merge's stamps are globaltimer from the first program's start; rows left at -1 (programs that did not run) are
    dropped; the timer's step is the smallest gap between its distinct readings."""
    from glm5lab.bench import latency_anatomy

    att = [_stamped_program(1000, 100, 2000), [-1] * 16, _stamped_program(1200, 5000, 2200)]
    merge = [[2300, 2400, 2600] + [-1] * 13, [2250, 2450, 2700] + [-1] * 13, [-1] * 16]
    got = latency_anatomy.phase_parts(att, merge)
    want = {"ns_per_clock": 0.5, "programs": 2, "program_start_us": 0.1, "last_program_start_us": 0.2,
            **{f"phase{k}_us": 0.05 * k for k in range(2, 12)}, "phase12_us": 1.0, "attention_end_us": 1.1,
            "last_attention_end_us": 1.2, "merge_programs": 2, "merge_start_us": 1.275, "merge_released_us": 1.425,
            "merge_end_us": 1.65, "last_merge_end_us": 1.7, "globaltimer_step_ns": 50.0}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    assert latency_anatomy.phase_parts([[-1] * 16], []) == {}


def test_phase_stamps_are_refused_by_a_kernel_that_writes_none():
    """Only the 1-3 token fp8_ds_mla mma.sync kernel (and, wave stamps, the dual and paired fp8_ds_mla kernels) write
    stamps; asking another for them (or giving a buffer smaller than its grid) is a one-line error before any
    launch."""
    from glm5lab.kernels import sparse_mla_sm90

    from glm5lab.kernels import sparse_mla as sm

    small = (torch.empty(16, 16, dtype=torch.int64), None)
    rows = {**sparse_mla_sm90.ROWS_FP8_CONFIG, "_stamps": small}
    with pytest.raises(Glm5labError, match="_sparse_mla_rows_fp8_sm90_kernel writes none"):
        sparse_mla_sm90.launch((1, 1, 1), (), rows, False, True)
    mma = {**sparse_mla_sm90.DEFAULT_CONFIG, "_stamps": small}
    with pytest.raises(Glm5labError, match="holds 256 values, fewer than its 64 programs"):
        sparse_mla_sm90.launch((1, 1, 64), (), mma, True, True)
    with pytest.raises(Glm5labError, match="an int64 tensor, got torch.float32"):
        sparse_mla_sm90.launch((1, 1, 1), (), {**mma, "_stamps": (torch.empty(16, 16), None)}, False, True)
    part_o, part_lse = torch.zeros(1, 64, 8, 512), torch.zeros(1, 64, 8)
    out, lse = torch.empty(1, 8, 512, dtype=torch.bfloat16), torch.empty(1, 8)
    with pytest.raises(Glm5labError, match="of the merge: the buffer holds 256 values, fewer than its 128"):
        sm.launch_merge(*sm.merge_plan(8, 64), part_o, part_lse, out, lse, stamps=small[0])
    q, cache, slots, _ = make_case(1, 8, 64, 128, torch.bfloat16, "fp8_ds_mla", "cpu")
    with pytest.raises(Glm5labError, match="add 'impl': 'gluon'"):
        sparse_mla_attention(q, cache, slots, SCALE, _config={"_stamps": small})


@pytest.mark.gpu
def test_gpu_phase_stamps_leave_the_results_alone_and_come_in_order(device):
    """8 heads fp8_ds_mla x 1 token (64 splits), the merge in stream order: the stamped build's output and lse are
    the unstamped one's, bit for bit; every attention program (64) and merge program wrote its stamps, each
    program's clock stamps in order; the merge starts and is released no earlier than the last attention program
    ended (less the timer's step)."""
    from glm5lab.bench import latency_anatomy
    from glm5lab.kernels import sparse_mla as sm
    from glm5lab.kernels.sparse_mla import STAMP_SLOTS

    gen = torch.Generator(device=device).manual_seed(5)
    cache = quantize_fp8_ds_mla(torch.randn(64, 64, 576, device=device, generator=gen).to(torch.bfloat16))
    q = torch.randn(1, 8, 576, device=device, generator=gen).to(torch.bfloat16)
    slots = torch.randint(0, 4096, (1, 2048), device=device, dtype=torch.int32, generator=gen)
    slots[0, ::7] = -1
    cfg = {"impl": "gluon", "pdl": False}
    want = sparse_mla_attention(q, cache, slots, mla_softmax_scale(), _config=cfg)
    bufs = tuple(torch.full((4096, STAMP_SLOTS.value), -1, dtype=torch.int64, device=device) for _ in "am")
    got = sparse_mla_attention(q, cache, slots, mla_softmax_scale(), _config={**cfg, "_stamps": bufs})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    att, merge = ([r for r in b.tolist() if r[0] >= 0] for b in bufs)
    _, mh, dc, _ = sm.merge_plan(8, 64)
    assert len(att) == 64 and len(merge) == (8 // mh) * (512 // dc)        # every program of both grids
    assert all(r[1] <= r[2] <= r[3] <= r[14] <= r[15] <= r[4] <= r[5] <= r[6] <= r[7] <= r[12] and r[0] <= r[13]
               for r in att)
    assert all(r[0] <= r[1] <= r[2] for r in merge)
    parts = latency_anatomy.phase_parts(att, merge)
    step_ns = parts["globaltimer_step_ns"]
    assert 0.2 < parts["ns_per_clock"] < 2.0                  # a 0.5-5 GHz SM clock
    assert min(r[0] for r in merge) >= max(r[13] for r in att) - step_ns     # stream order: after every program
    assert parts["phase12_us"] > parts["phase2_us"] > 0


@pytest.mark.gpu
def test_gpu_latency_anatomy_writes_every_case(tmp_path):
    from glm5lab.bench import latency_anatomy

    rows = latency_anatomy.run(tmp_path / "anatomy.csv", verbose=False)
    assert len(rows) == 1 + 2 * 2 * len(latency_anatomy.cases())
    assert all(r["value"] > 0 for r in rows)


def test_fp8_without_native_e4m3_runs_the_f16_path_with_bit_conversion(device, monkeypatch):
    """On GPUs where Triton has no float8e4nv (SM80/86, ROCm) every fp8_ds_mla tile -- the 64-head one too, whose
    default is the "default" path -- runs the "f16" path with the bit-level e4m3 -> fp16 conversion, and a
    private path that needs float8e4nv is refused by name. (The interpreter has float8e4nv; the test takes it
    away.) Every byte pattern, so the bit conversion is checked on subnormals, +-448 and -0 too."""
    from glm5lab.kernels import sparse_mla

    monkeypatch.setattr(sparse_mla, "_native_e4m3", lambda dev: False)
    for H in (8, 64):
        q, cache, slots, ref = _raw_fp8_case(device, H=H)
        out, lse = run_poisoned(q, cache, slots, _config={"impl": "triton"})   # (on sm_90 the default is Gluon)
        check(out, lse, ref, torch.bfloat16)
    with pytest.raises(Glm5labError, match="needs Triton's float8e4nv"):
        sparse_mla_attention(q, cache, slots, SCALE, _config={"fp8_path": "reload"})


@pytest.mark.gpu
@pytest.mark.parametrize("H,T", [(8, 1), (16, 37), (64, 8), (128, 130)])
def test_gpu_fp8_without_native_e4m3_real_shapes(monkeypatch, H, T):
    """What SM80/86 run for fp8_ds_mla (no float8e4nv: the "f16" path with the bit-level e4m3 conversion), compiled
    and run on this GPU at real shapes through both merges, and on every byte pattern."""
    from glm5lab.kernels import sparse_mla

    monkeypatch.setattr(sparse_mla, "_native_e4m3", lambda dev: False)
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    for merge in ("fused", "separate"):
        out, lse = run_poisoned(q, cache, slots, merge=merge, _config={"impl": "triton"})
        check(out, lse, ref, torch.bfloat16)
    q, cache, slots, ref = _raw_fp8_case("cuda", H=H)
    out, lse = run_poisoned(q, cache, slots, _config={"impl": "triton"})
    check(out, lse, ref, torch.bfloat16)

