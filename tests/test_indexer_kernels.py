"""glm5lab's Triton DSA indexer kernels (decode logits on a paged index-key cache, prefill logits, top-k)
against the float64 torch reference. CPU: TRITON_INTERPRET=1 with small shapes; `gpu` tests: GLM-5 shapes.

Tolerances: logits are compared with atol = 2e-3 * max|logit| for fp16/bf16 operands (products are exact
in fp32, the sum over D=128 and the heads is accumulated in fp32) and 1e-5 * max|logit| for fp32.
Top-k sets are compared with the tie rule of glm5lab.sparse.indexer_reference: identical up to ties at the
k-th score, where (end to end) "tied" means within the logits tolerance.
"""
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5lab.errors import Glm5labError
from glm5lab.kernels.dsa_indexer import (TOPK_METHODS, dequantize_index_key_cache, fp8_cache_views,
                                         indexer_logits_decode, indexer_logits_prefill, indexer_topk,
                                         quantize_keys_fp8, torch_topk, write_index_key_cache)
from glm5lab.sparse.indexer_reference import (indexer_logits_reference, indexer_topk_reference,
                                              topk_sets_agree)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Triton 3.6's interpreter warns about numpy scalar conversions on every loop bound
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _tol(dtype, ref):
    scale = float(ref[torch.isfinite(ref)].abs().max()) if torch.isfinite(ref).any() else 1.0
    return (1e-5 if dtype == torch.float32 else 2e-3) * max(scale, 1.0)


def _paged_case(gen, *, T, H, D, page, num_blocks, max_len, dtype, fp8, device="cpu", lengths=None):
    """Random keys written into a paged cache through a random (permuted) block table per row."""
    cache = (torch.zeros(num_blocks, page, D + 4, dtype=torch.uint8) if fp8
             else torch.zeros(num_blocks, page, D, dtype=dtype))
    keys = torch.randn(num_blocks * page, D, generator=gen)
    write_index_key_cache(cache, keys.to(dtype), torch.arange(num_blocks * page))
    blocks_per_row = -(-max_len // page)
    bt = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_row] for _ in range(T)]).int()
    if lengths is None:
        lengths = torch.randint(0, max_len + 1, (T,), generator=gen)
        lengths[0] = max_len
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    w = torch.randn(T, H, generator=gen) / H
    return [x.to(device) for x in (q, w, cache, bt, lengths.int())]


def _decode_reference(q, w, cache, bt, lengths, max_len):
    D = q.shape[-1]
    flat = dequantize_index_key_cache(cache, D).reshape(-1, D).double()
    ref = torch.full((q.shape[0], max_len), float("-inf"), dtype=torch.float64, device=q.device)
    page = cache.shape[1]
    for t in range(q.shape[0]):
        n = int(lengths[t])
        slots = (bt[t].long()[:, None] * page + torch.arange(page, device=q.device)).reshape(-1)[:n]
        ref[t, :n] = indexer_logits_reference(q[t:t + 1], flat[slots], w[t:t + 1],
                                              compute_dtype=torch.float64)[0]
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_decode_logits_match_reference(dtype, fp8, device):
    gen = torch.Generator().manual_seed(11 + DTYPES.index(dtype) + 7 * fp8)
    T, H, D, page, max_len = 3, 5, 128, 16, 45           # odd head count, odd lengths, padded heads
    q, w, cache, bt, lengths = _paged_case(gen, T=T, H=H, D=D, page=page, num_blocks=7, max_len=max_len,
                                           dtype=dtype, fp8=fp8, device=device)
    ref = _decode_reference(q, w, cache, bt, lengths, max_len).cpu()
    finite = torch.isfinite(ref)
    # the default tiling, 16-key tiles three a program (a program's last tiles past every row's end), both dot orders,
    # the sum over D in the fragments' order
    for tiling in ({}, {"block_n": 16, "tiles": 3, "num_stages": 2}, {"keys_as_m": True}, {"keys_as_m": False},
                   {"keys_as_m": True, "permute_d": True}, {"block_n": 16, "tiles": 3, "permute_d": True}):
        out = torch.full((T, max_len), float("nan"), device=device)   # poisoned: every entry must be written
        indexer_logits_decode(q, w, cache, bt, lengths, max_len=max_len, out=out, **tiling)
        out = out.cpu()
        assert not torch.isnan(out).any(), tiling
        assert torch.equal(torch.isneginf(out), ~finite), tiling
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(dtype, ref), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_decode_logits_of_empty_rows_and_padded_block_tables(dtype, fp8, device):
    """vLLM pads a block table past a row's last block with -1 and a row may hold no keys yet: the kernel must not
    read through a -1 block id (it would index before the cache) and must write -inf across an empty row."""
    gen = torch.Generator().manual_seed(31 + DTYPES.index(dtype) + 7 * fp8)
    T, H, D, page, max_len = 3, 5, 128, 16, 45
    q, w, cache, bt, lengths = _paged_case(gen, T=T, H=H, D=D, page=page, num_blocks=7, max_len=max_len, dtype=dtype,
                                           fp8=fp8, device=device, lengths=torch.tensor([max_len, 10, 0]))
    bt[1, 1:] = -1      # 10 keys: one block, the rest padding
    bt[2] = -1          # no keys: nothing but padding
    ref = _decode_reference(q, w, cache, bt, lengths, max_len).cpu()
    assert torch.isfinite(ref[1, :10]).all() and torch.isneginf(ref[1, 10:]).all() and torch.isneginf(ref[2]).all()
    for tiling in ({}, {"block_n": 16, "tiles": 3, "num_stages": 2}, {"keys_as_m": True}, {"keys_as_m": False}):
        out = torch.full((T, max_len), float("nan"), device=device)
        indexer_logits_decode(q, w, cache, bt, lengths, max_len=max_len, out=out, **tiling)
        out = out.cpu()
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), tiling
        finite = torch.isfinite(ref)
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(dtype, ref), rtol=0)


@pytest.mark.parametrize("D", [40, 128])
def test_the_sum_over_d_in_fragment_order_is_the_same_sum(D, device):
    """permute_d reorders q's and the keys' last dimension alike (padded to a power of two: D = 40 sums 64 columns,
    24 of them zero on both sides), so the logits are the reference's; fp8 and bf16 keys, both dot orders."""
    gen = torch.Generator().manual_seed(23 + D)
    for fp8 in (False, True):
        q, w, cache, bt, lengths = _paged_case(gen, T=2, H=3, D=D, page=16, num_blocks=6, max_len=70,
                                               dtype=torch.bfloat16, fp8=fp8, device=device)
        ref = _decode_reference(q, w, cache, bt, lengths, 70).cpu()
        finite = torch.isfinite(ref)
        for keys_as_m in (False, True):
            out = torch.full((2, 70), float("nan"), device=device)
            indexer_logits_decode(q, w, cache, bt, lengths, max_len=70, out=out, keys_as_m=keys_as_m, permute_d=True)
            out = out.cpu()
            assert torch.equal(torch.isneginf(out), ~finite), (fp8, keys_as_m)
            torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0)


def test_an_e4m3_q_meets_fp8_keys_in_an_fp8_dot(device):
    """vLLM's indexer hands over q in e4m3 (its scale folded into the weights): with fp8 keys the dot takes both as
    they are, in both orders and tilings, and equals the reference on the e4m3 values; with bf16 keys, or the soft
    conversion of GPUs before SM89, q is widened to bf16 (exact), bit for bit the bf16 q's logits."""
    gen = torch.Generator().manual_seed(29)
    for fp8 in (True, False):
        q, w, cache, bt, lengths = _paged_case(gen, T=3, H=5, D=128, page=16, num_blocks=7, max_len=45,
                                               dtype=torch.bfloat16, fp8=fp8, device=device)
        q8 = q.to(torch.float8_e4m3fn)
        wide = q8.to(torch.bfloat16)
        ref = _decode_reference(wide, w, cache, bt, lengths, 45).cpu()
        finite = torch.isfinite(ref)
        tilings = ({}, {"keys_as_m": True}, {"keys_as_m": False, "block_n": 16, "tiles": 3},
                   {"keys_as_m": True, "permute_d": True}) if fp8 else ({},)
        for kw in tilings:
            out = torch.full((3, 45), float("nan"), device=device)
            indexer_logits_decode(q8, w, cache, bt, lengths, max_len=45, out=out, **kw)
            out = out.cpu()
            assert torch.equal(torch.isneginf(out), ~finite), kw
            torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0)
        for kw in ({"soft_fp8": True},) if fp8 else ({},):
            assert torch.equal(indexer_logits_decode(q8, w, cache, bt, lengths, **kw),
                               indexer_logits_decode(wide, w, cache, bt, lengths, **kw)), fp8
    with pytest.raises(Glm5labError, match="float8_e4m3fn, got torch.int8"):
        indexer_logits_decode(q.to(torch.int8), w, cache, bt, lengths)


@pytest.mark.parametrize("q_dtype", DTYPES)
def test_software_fp8_decode_equals_hardware_conversion(q_dtype, device):
    """GPUs before SM89 have no e4m3: the kernel moves the bits into fp16 (the keys times 2^-8, the 2^8 put into the
    scale). Same logits, bit for bit, with the dot in q's dtype (fp32 q: an IEEE dot) and in fp16."""
    gen = torch.Generator().manual_seed(17)
    q, w, cache, bt, lengths = _paged_case(gen, T=2, H=8, D=128, page=16, num_blocks=5, max_len=60,
                                           dtype=q_dtype, fp8=True, device=device)
    values, _ = fp8_cache_views(cache, 128)
    bits = torch.arange(256, dtype=torch.uint8).repeat(8).view(16, 128)
    bits[bits % 128 == 127] = 0                                   # every bit pattern except NaN
    values[bt[0, 0].long()] = bits.to(device)
    for f16_dot in (True, False) if q_dtype != torch.float32 else (False,):
        for keys_as_m in (False, True):
            hard = indexer_logits_decode(q, w, cache, bt, lengths, soft_fp8=False, f16_dot=f16_dot, keys_as_m=keys_as_m)
            soft = indexer_logits_decode(q, w, cache, bt, lengths, soft_fp8=True, f16_dot=f16_dot, keys_as_m=keys_as_m)
            assert torch.equal(hard, soft), (f16_dot, keys_as_m)
    ref = _decode_reference(q, w, cache, bt, lengths, 60)
    finite = torch.isfinite(ref)
    torch.testing.assert_close(soft[finite].double().cpu(), ref[finite].cpu(), atol=_tol(torch.float16, ref), rtol=0)


@pytest.mark.parametrize("q_dtype, magnitude", [(torch.float16, 1.0), (torch.bfloat16, 1.0), (torch.bfloat16, 3e6),
                                                (torch.bfloat16, 1e-7)])
def test_fp8_keys_dot_in_fp16_keeps_every_query_range(magnitude, q_dtype, device):
    """fp8 keys with an fp16/bf16 q run the dot in fp16 (one conversion per two key values): q is scaled per head
    by a power of two into fp16's range and back. A bf16 q far beyond fp16's (3e6: inf unscaled; 1e-7: subnormal,
    percents off unscaled), one head of zeros, and the dot kept in q's dtype (f16_dot=False) all give the reference's
    logits; f16_dot on keys that are not fp8 is refused by name."""
    gen = torch.Generator().manual_seed(19)
    q, w, cache, bt, lengths = _paged_case(gen, T=3, H=6, D=128, page=16, num_blocks=6, max_len=70,
                                           dtype=torch.float32, fp8=True, device=device)
    q = (q * magnitude * torch.logspace(-3, 3, 6, base=2.0, device=device)[None, :, None]).to(q_dtype)
    q[1, 2] = 0
    ref = _decode_reference(q, w, cache, bt, lengths, 70)
    finite = torch.isfinite(ref)
    atol = 2e-3 * float(ref[finite].abs().max())       # _tol's, without its floor of 1 (these logits are ~1e-5)
    for f16_dot in (None, True, False):
        out = torch.full_like(ref, float("nan"), dtype=torch.float32)
        indexer_logits_decode(q, w, cache, bt, lengths, max_len=70, out=out, f16_dot=f16_dot)
        assert torch.equal(torch.isneginf(out), ~finite), f16_dot
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=atol, rtol=0,
                                   msg=lambda m: f"f16_dot={f16_dot}: {m}")
    plain = torch.randn(6, 16, 128, generator=gen).to(device, q_dtype)
    with pytest.raises(Glm5labError, match="f16_dot needs an fp8 key cache"):
        indexer_logits_decode(q, w, plain, bt, lengths, f16_dot=True)


def test_fp8_cache_layout_matches_vllm_deepgemm_layout():
    """Inside a block: block_size*D fp8 values (token-major), then block_size float32 power-of-two scales."""
    D, page = 128, 4
    cache = torch.zeros(3, page, D + 4, dtype=torch.uint8)
    k = torch.randn(2, D) * torch.tensor([[0.01], [30.0]])
    write_index_key_cache(cache, k, torch.tensor([6, -1]))        # block 1, offset 2; -1 skipped
    raw = cache.reshape(3, -1)[1]
    vals = raw[2 * D:3 * D].view(torch.float8_e4m3fn).float()
    scale = raw[page * D + 2 * 4: page * D + 3 * 4].view(torch.float32)
    assert float(torch.log2(scale)) == round(float(torch.log2(scale)))   # ue8m0: power of two
    assert float(vals.abs().max() * scale) <= float(k[0].abs().max()) * 1.07
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative); below its normal range (2^-6) a fixed step of 2^-9, so a
    # value that small is off by up to 2^-10 in the cache's units (times its scale)
    torch.testing.assert_close(vals * scale, k[0], atol=float(scale) * 2 ** -10, rtol=2 ** -4)
    assert int(cache.reshape(3, -1)[[0, 2]].count_nonzero()) == 0    # nothing else written
    values, scales = fp8_cache_views(cache, D)
    assert values.data_ptr() == cache.data_ptr() and scales.shape == (3, page)


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_cache_as_a_strided_view_into_a_shared_allocation(fp8, device):
    """vLLM gives each layer a view into one allocation (blocks strided apart): writes must land in it and
    the kernel must read it through its strides, leaving the other layer's bytes alone."""
    gen = torch.Generator().manual_seed(13)
    width, dtype = (132, torch.uint8) if fp8 else (128, torch.float16)
    big = torch.zeros(6, 2, 16, width, dtype=dtype, device=device)
    cache = big[:, 1]
    assert not cache.is_contiguous()
    keys = torch.randn(96, 128, generator=gen).half().to(device)
    write_index_key_cache(cache, keys, torch.randperm(96, generator=gen).to(device))
    assert int(big[:, 0].count_nonzero()) == 0 and int(cache.count_nonzero()) > 0
    q = torch.randn(2, 8, 128, generator=gen).half().to(device)
    w = torch.randn(2, 8, generator=gen).to(device)
    bt = torch.stack([torch.randperm(6, generator=gen) for _ in range(2)]).int().to(device)
    lengths = torch.tensor([96, 50], dtype=torch.int32, device=device)
    out = indexer_logits_decode(q, w, cache, bt, lengths)
    ref = _decode_reference(q, w, cache, bt, lengths, 96).cpu()
    out = out.cpu()
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.float16, ref), rtol=0)


def _prefill_windows(gen, T, S):
    ks = torch.randint(0, 12, (T,), generator=gen)
    ke = ks + torch.randint(0, S - 12 + 1, (T,), generator=gen)
    ke[0] = ks[0]                                                # an empty window
    ks[-3:-1] = S - 10                                           # two rows whose windows start late: a tiled
    ke[-3:-1] = torch.tensor([S, S - 5])                         # program skips its first tiles for them
    return ks, ke


def _prefill_reference(q, w, keys, ks, ke, max_len):
    ref = torch.full((q.shape[0], max_len), float("-inf"), dtype=torch.float64)
    for t in range(q.shape[0]):
        n = int(ke[t] - ks[t])
        ref[t, :n] = indexer_logits_reference(q[t:t + 1].float(), keys[ks[t]:ke[t]], w[t:t + 1],
                                              compute_dtype=torch.float64)[0]
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_logits_match_reference(dtype, device):
    gen = torch.Generator().manual_seed(21 + DTYPES.index(dtype))
    T, H, D, S = 13, 6, 128, 40
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    w = torch.randn(T, H, generator=gen) / H
    k = torch.randn(S, D, generator=gen).to(dtype)
    ks, ke = _prefill_windows(gen, T, S)
    ref = _prefill_reference(q, w, k.double(), ks, ke, int((ke - ks).max()))
    finite = torch.isfinite(ref)
    # one tile a program, and 16-key tiles three a program (windows starting and ending inside a program's range)
    # (block_m 2: rows 10-11, windows [30, 40) and [30, 35), make one program whose first tile is skipped); the dot
    # as keys . q^T, its heads' sum along the MMA's N (block_m 3 -> 4 tokens, 4 x 8 = 32 q rows)
    for tiling in ({}, {"block_n": 16, "tiles": 3}, {"block_m": 2, "block_n": 16, "tiles": 2, "num_stages": 3},
                   {"keys_as_m": True}, {"block_m": 3, "block_n": 32, "tiles": 2, "keys_as_m": True}):
        out = indexer_logits_prefill(q.to(device), w.to(device), k.to(device), ks.to(device), ke.to(device),
                                     **tiling).cpu()
        assert torch.equal(torch.isneginf(out), ~finite), tiling
        torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(dtype, ref), rtol=0)


@pytest.mark.parametrize("q_dtype", DTYPES + [torch.float8_e4m3fn], ids=["fp16", "bf16", "fp32", "e4m3"])
@pytest.mark.parametrize("D", [128, 40])
def test_prefill_logits_read_fp8_keys_as_vllm_gathers_them(q_dtype, D, device):
    """vLLM gathers a prefill chunk's keys from its fp8 index-key cache as (e4m3 values, float32 scale a key): the
    prefill logits read that pair as it is (e4m3 or its uint8 bytes), scale after the heads' sum, and equal the
    reference on the dequantized keys -- with a 16/32-bit q (keys converted in the kernel), an e4m3 q (the fp8 x fp8
    dot, on the e4m3 values), and the soft conversion of GPUs before SM89 (bit for bit the hardware conversion's
    logits; for an e4m3 q, the bf16-widened q's)."""
    gen = torch.Generator().manual_seed(41 + D + DTYPES.index(q_dtype) if q_dtype in DTYPES else 47 + D)
    T, H, S = 13, 6, 40
    q = torch.randn(T, H, D, generator=gen).to(q_dtype)
    w = torch.randn(T, H, generator=gen) / H
    values, scales = quantize_keys_fp8(torch.randn(S, D, generator=gen) * torch.logspace(-2, 2, S)[:, None])
    ks, ke = _prefill_windows(gen, T, S)
    keys = values.double() * scales.double()[:, None]
    ref = _prefill_reference(q, w, keys, ks, ke, int((ke - ks).max()))
    finite = torch.isfinite(ref)
    dev = [x.to(device) for x in (q, w, values, scales, ks, ke)]
    qd, wd, vd, sd, ksd, ked = dev
    outs = {}
    for name, pair in (("e4m3", (vd, sd)), ("bytes", (vd.view(torch.uint8), sd))):
        for soft in (False, True):
            out = indexer_logits_prefill(qd, wd, pair, ksd, ked, soft_fp8=soft).cpu()
            # (and Hopper's default tiling: keys . q^T, 16 tiles a program, 3 stages -- at 16 keys a tile here)
            for tiling in ({"block_n": 16, "tiles": 2}, {"block_n": 16, "tiles": 2, "keys_as_m": True},
                           {"block_n": 16, "tiles": 16, "num_stages": 3, "keys_as_m": True}):
                tiled = indexer_logits_prefill(qd, wd, pair, ksd, ked, soft_fp8=soft, **tiling).cpu()
                torch.testing.assert_close(tiled, out, atol=_tol(q_dtype, ref), rtol=0, msg=lambda m: f"{tiling}: {m}")
            assert torch.equal(torch.isneginf(out), ~finite), (name, soft)
            torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(q_dtype, ref), rtol=0,
                                       msg=lambda m: f"{name} soft={soft}: {m}")
            outs[name, soft] = out
    assert torch.equal(outs["e4m3", False], outs["bytes", False])
    if q_dtype == torch.float8_e4m3fn:     # soft: q widened to bf16, the keys converted to it
        wide = indexer_logits_prefill(qd.to(torch.bfloat16), wd, (vd, sd), ksd, ked, soft_fp8=False).cpu()
        assert torch.equal(outs["e4m3", True], wide)
    else:
        assert torch.equal(outs["e4m3", True], outs["e4m3", False])


def test_prefill_logits_name_bad_fp8_keys():
    q, w = torch.randn(2, 4, 128), torch.randn(2, 4)
    values, scales = quantize_keys_fp8(torch.randn(5, 128))
    ks, ke = torch.tensor([0, 1]), torch.tensor([3, 5])
    for k, match in (((values,), "a pair"), ((values, scales, scales), "a pair"),
                     ((values.float(), scales), "float8_e4m3fn or uint8, got torch.float32"),
                     ((values[:, :64], scales), r"values must be \[keys, 128\]"),
                     ((values, scales.double()), r"scales must be float32 \[5\]"),
                     ((values, scales[:4]), "one a key"),
                     (torch.randn(5, 128).to(torch.float8_e4m3fn), "or an fp8 pair")):
        with pytest.raises(Glm5labError, match=match):
            indexer_logits_prefill(q, w, k, ks, ke)
    with pytest.raises(Glm5labError, match="float8_e4m3fn, got torch.int8"):
        indexer_logits_prefill(q.to(torch.int8), w, (values, scales), ks, ke)
    with pytest.raises(Glm5labError, match="0 <= ks <= ke <= 5"):
        indexer_logits_prefill(q, w, (values, scales), ks, ke + 1)
    for bad, match in (({"tiles": 0}, "^tiles must be an integer >= 1, got 0$"),
                       ({"num_stages": 0}, "^num_stages must be an integer >= 1, got 0$"),
                       ({"block_m": 0}, "^block_m must be an integer >= 1, got 0$"),
                       ({"block_m": 2.0}, "^block_m must be an integer >= 1, got 2.0$"),
                       ({"block_n": 48}, "^block_n must be a power of two >= 16, got 48$"),
                       ({"block_n": 8}, "^block_n must be a power of two >= 16, got 8$")):
        with pytest.raises(Glm5labError, match=match):
            indexer_logits_prefill(q, w, (values, scales), ks, ke, **bad)


def test_prefill_tiling_default_pipelines_key_tiles_only_where_timed():
    """Hopper's keys . q^T prefill runs 16 key tiles a program, 3 in flight (H100, NOTES v61); q . keys^T, other GPUs
    and the CPU keep one tile a program, as before v61."""
    from glm5lab.kernels.dsa_indexer import prefill_tiling_default

    hopper = prefill_tiling_default((9, 0), keys_as_m=True)
    assert hopper[1] > 1 and hopper[2] > 1
    for capability, keys_as_m in (((9, 0), False), ((12, 0), True), ((8, 6), True), ((10, 0), True), (None, True)):
        assert prefill_tiling_default(capability, keys_as_m)[1:] == (1, 2), (capability, keys_as_m)
    assert {prefill_tiling_default(c, k)[0] for c in ((9, 0), (12, 0), None) for k in (False, True)} == {64}


def _check_topk_exact(logits, k, lengths, method="radix16"):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = indexer_topk(logits.to(dev), k, lengths.to(dev), method=method,
                       out=torch.full((logits.shape[0], k), 12345, dtype=torch.int32, device=dev)).cpu()
    ref = indexer_topk_reference(logits, k, lengths)
    assert torch.equal(out, ref), (out, ref)
    assert topk_sets_agree(out, logits, k, lengths) == []


@pytest.mark.parametrize("method", TOPK_METHODS)
def test_topk_random_rows_equal_reference(method):
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(7, 300, generator=gen) * 10
    lengths = torch.tensor([300, 0, 1, 37, 38, 299, 200])
    _check_topk_exact(logits, 37, lengths, method)               # k not a power of two, rows < = > k


@pytest.mark.parametrize("method", TOPK_METHODS)
def test_topk_constructed_ties(method):
    """Integer scores: many exact ties at the k-th score, plus -0.0/+0.0 and -inf inside the row."""
    gen = torch.Generator().manual_seed(32)
    logits = torch.randint(-3, 4, (5, 130), generator=gen).float()
    logits[0, ::3] = -0.0
    logits[1, :] = 0.0
    logits[1, 1::2] = -0.0
    logits[2, 5:50] = float("-inf")
    lengths = torch.tensor([130, 130, 130, 64, 17])
    _check_topk_exact(logits, 16, lengths, method)
    # another legal tie choice (from torch.topk) passes the rule too, and a wrong one does not
    other = torch_topk(logits, 16, lengths)
    assert topk_sets_agree(other, logits, 16, lengths) == []
    wrong = indexer_topk_reference(-logits, 16, lengths)
    assert topk_sets_agree(wrong, logits, 16, lengths) != []


def _bit_order_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in the order of the float's bits (sign, then magnitude), -0.0 as +0.0: a NaN with its
    sign bit clear lands above +inf, one with it set below -inf."""
    x = torch.where(x == 0, torch.zeros_like(x), x)
    b = x.view(torch.int32).long()
    return torch.where(b >= 0, b, -(b & 0x7FFFFFFF) - 1)


@pytest.mark.parametrize("on", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", TOPK_METHODS)
def test_topk_orders_nan_by_its_bits(method, on):
    """NaN has no place in the order of values; the radix passes give it the place of its bits. The contract
    (indexer_topk's docstring): a positive NaN ranks above +inf, a negative one below -inf, ties lowest first."""
    gen = torch.Generator().manual_seed(33)
    logits = torch.randn(5, 200, generator=gen)
    logits[0, [3, 150]] = float("nan")
    logits[1, [7, 9]] = -float("nan")
    logits[1, 11] = float("-inf")
    logits[2, :] = float("nan")
    logits[3, ::2] = -float("nan")
    logits[4, [0, 1]] = torch.tensor([float("inf"), float("nan")])
    lengths = torch.tensor([200, 200, 200, 21, 150])
    assert logits.isnan().any(dim=1).all()
    out = indexer_topk(logits.to(on), 12, lengths.to(on), method=method).cpu()
    assert torch.equal(out, indexer_topk_reference(_bit_order_key(logits).double(), 12, lengths)), out
    assert 3 in out[0] and 150 in out[0] and 7 not in out[1] and 9 not in out[1]
    assert out[2].tolist() == list(range(12)) and 1 in out[4] and 0 in out[4]


@pytest.mark.parametrize("whole_row_max", [4096, 0], ids=["registers", "streaming"])
@pytest.mark.parametrize("method", TOPK_METHODS)
def test_topk_when_the_k_largest_end_exactly_at_a_digit(method, whole_row_max, monkeypatch):
    """K equal to how many scores lie at or above a value (2.0, 1.0, -2.0, -inf): the pick is exact at an early level
    (hist stops there). 2.0 and 1.0 have order keys that end in zero bytes, equal to the picked prefix itself: they
    must be taken, not only what lies above them."""
    import glm5lab.kernels.dsa_indexer as dsa

    monkeypatch.setattr(dsa, "HIST_WHOLE_ROW_MAX", whole_row_max)
    gen = torch.Generator().manual_seed(34)
    logits = torch.ones(4, 150)
    logits[0, torch.randperm(150, generator=gen)[:10]] = 2.0                     # the 10 largest: all of the 2.0s
    logits[1] = -3.0
    logits[1, torch.randperm(150, generator=gen)[:10]] = -2.0
    logits[2, torch.randperm(150, generator=gen)[:140]] = float("-inf")         # K = 10: the row's 1.0s
    logits[3, 37:] = float("-inf")                                              # K = the 37 ones, then -inf
    for k, rows in ((10, [0, 1, 2]), (37, [3])):
        _check_topk_exact(logits[rows], k, torch.full((len(rows),), 150), method)
    _check_topk_exact(logits[2:3], 150, torch.tensor([150]), method)           # K = n: all, -inf included


@pytest.mark.parametrize("whole_row_max", [4096, 0], ids=["registers", "streaming"])
def test_topk_hist_both_kernels_equal_reference(whole_row_max, monkeypatch):
    """"hist" keeps rows of up to HIST_WHOLE_ROW_MAX columns in registers and streams longer ones; both kernels,
    on random rows, heavy ties, -0.0 / -inf, empty and short rows."""
    import glm5lab.kernels.dsa_indexer as dsa

    monkeypatch.setattr(dsa, "HIST_WHOLE_ROW_MAX", whole_row_max)
    gen = torch.Generator().manual_seed(35)
    logits = torch.randn(6, 517, generator=gen) * 3
    logits[1] = torch.randint(-3, 3, (517,), generator=gen).float()
    logits[2, ::7] = -0.0
    logits[3, ::5] = float("-inf")
    lengths = torch.tensor([517, 517, 400, 300, 0, 9])
    for k in (1, 10, 64, 300, 600):
        _check_topk_exact(logits, k, lengths, "hist")


def test_topk_split_over_many_segments_equals_reference():
    """The multi-program top-k: rows cut into 32-column segments, ties spanning segment borders. Row 3's ties sit
    at negative integers, whose order keys end in the digit 255 (the segments' counts past the last bin), below a few
    positive logits."""
    gen = torch.Generator().manual_seed(33)
    logits = torch.randint(0, 4, (4, 333), generator=gen).float()
    logits[2] = torch.randn(333, generator=gen)
    logits[3] = -torch.randint(1, 4, (333,), generator=gen).float()
    logits[3, ::29] = torch.rand(12, generator=gen) + 0.5          # above the ties, in most segments
    lengths = torch.tensor([333, 100, 250, 333])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for k in (1, 40, 120):
        out = indexer_topk(logits.to(dev), k, lengths.to(dev), method="split", block=16, seg=32).cpu()
        assert torch.equal(out, indexer_topk_reference(logits, k, lengths))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), cols=st.integers(1, 200), k=st.integers(1, 70), seed=st.integers(0, 2 ** 16),
       tie_levels=st.sampled_from([0, 3]), method=st.sampled_from(TOPK_METHODS))
def test_topk_property(rows, cols, k, seed, tie_levels, method):
    gen = torch.Generator().manual_seed(seed)
    if tie_levels:
        logits = torch.randint(0, tie_levels, (rows, cols), generator=gen).float()
    else:
        logits = torch.randn(rows, cols, generator=gen)
    lengths = torch.randint(0, cols + 1, (rows,), generator=gen)
    _check_topk_exact(logits, k, lengths, method)


def test_decode_then_topk_end_to_end_agrees_with_reference_up_to_ties(device):
    gen = torch.Generator().manual_seed(41)
    T, H, D, page, max_len, k = 3, 8, 128, 8, 70, 24
    q, w, cache, bt, lengths = _paged_case(gen, T=T, H=H, D=D, page=page, num_blocks=12, max_len=max_len,
                                           dtype=torch.bfloat16, fp8=False, device=device,
                                           lengths=torch.tensor([70, 20, 51]))
    logits = indexer_logits_decode(q, w, cache, bt, lengths)
    top = indexer_topk(logits, k, lengths).cpu()
    ref = _decode_reference(q, w, cache, bt, lengths, max_len).cpu()
    assert topk_sets_agree(top, ref, k, lengths.cpu(), atol=_tol(torch.bfloat16, ref)) == []
    assert (top[1] == -1).sum() == k - 20


def test_bad_inputs_raise_clear_errors():
    q = torch.randn(2, 4, 128, dtype=torch.float16)
    w = torch.randn(2, 4)
    cache = torch.zeros(3, 8, 128, dtype=torch.float16)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    with pytest.raises(Glm5labError, match="weights"):
        indexer_logits_decode(q, torch.randn(2, 3), cache, bt, lens)
    with pytest.raises(Glm5labError, match="k_cache"):
        indexer_logits_decode(q, w, torch.zeros(3, 8, 64, dtype=torch.float16), bt, lens)
    with pytest.raises(Glm5labError, match="block table"):
        indexer_logits_decode(q, w, cache, bt, torch.tensor([5, 30], dtype=torch.int32))
    with pytest.raises(Glm5labError, match="q must be"):
        indexer_logits_decode(q.to(torch.int8), w, cache, bt, lens)
    with pytest.raises(Glm5labError, match="ks"):
        indexer_logits_prefill(q, w, torch.randn(4, 128, dtype=torch.float16), torch.tensor([0, 2]),
                               torch.tensor([3, 9]))
    with pytest.raises(Glm5labError, match="logits"):
        indexer_topk(torch.randn(2, 5, dtype=torch.float64), 3)
    with pytest.raises(Glm5labError, match="slot"):
        write_index_key_cache(cache, torch.randn(1, 128), torch.tensor([24]))


# ------------------------------------------------------------------------------------ GPU, GLM-5 shapes
@pytest.mark.measured
def test_the_top_k_rule_picks_the_kernel_measured_fastest_in_a_cuda_graph():
    """`fastest_topk_method` is what the vLLM indexer op and the projection run; it must pick, for every shape a
    committed GPU run graph-timed both kernels at, one within 5% of the faster. A shape's time is the mean over the
    logits it was timed on (the bench's bf16 and fp8 caches give two sets): since v52 hist stops early when a pick
    leaves no tie, so its time depends on the data (4k x 32 rows: 13.2 / 16.0 us on the two sets, against split's
    15.2), which a rule by shape cannot see."""
    import pandas as pd

    from glm5lab.kernels.dsa_indexer import fastest_topk_method

    assert fastest_topk_method(65536, 1, on_gpu=False) == "radix16"
    assert [fastest_topk_method(L, B) for L, B in ((4096, 1), (16384, 1), (4096, 32), (4096, 256), (65536, 128))] == [
        "split", "split", "hist", "hist", "split"]
    shapes = 0
    for csv in sorted((Path(__file__).resolve().parents[1] / "results").glob("**/bench/gpu/indexer.csv")):
        d = pd.read_csv(csv)
        d = d[(d.metric == "topk_time_graph") & d.implementation.isin(["glm5lab-triton-hist", "glm5lab-triton-split"])]
        d = d.drop_duplicates(["shape", "dtype", "implementation"], keep="last")       # the latest run's
        for shape, g in d.groupby("shape"):
            times = g.groupby(g.implementation.str.removeprefix("glm5lab-triton-")).value.mean().to_dict()
            rows, columns = (int(x) for x in re.match(r"B(\d+)_L(\d+)_", shape).groups())
            pick = fastest_topk_method(columns, rows)
            assert times[pick] <= 1.05 * min(times.values()), (csv, shape, pick, times)
            shapes += 1
    assert shapes >= 12, "no committed graph-timed top-k rows to check the rule against"


@pytest.mark.measured
def test_the_dot_order_follows_the_measurements():
    """keys . q^T (a wgmma with the keys as M) is the default for fp8 keys on Hopper only, where the committed H100
    rows time it no slower than q . keys^T at every shape and tile both were timed at (NOTES.md v56: 1.01-1.14x faster);
    bf16 keys, other GPUs and the CPU keep q . keys^T."""
    import pandas as pd

    from glm5lab.kernels.dsa_indexer import keys_as_m_default

    assert keys_as_m_default(True, (9, 0)) and not keys_as_m_default(False, (9, 0))
    for other in ((8, 0), (8, 9), (10, 0), (12, 0)):
        assert not keys_as_m_default(True, other), other
    assert not keys_as_m_default(True, None)
    runs = Path(__file__).resolve().parents[1] / "results" / "h100" / "indexer"
    d = pd.concat([pd.read_csv(runs / "logits_ab.csv"), pd.read_csv(runs / "logits_ab_history.csv.gz")])
    d = d[(d.metric == "logits_time_graph") & (d.dtype == "fp8") & d.implementation.str.endswith(("-kq", "-qk"))]
    d = d.assign(tile=d.implementation.str[:-3], order=d.implementation.str[-2:])
    both = d.pivot_table(index=["shape", "tile"], columns="order", values="value").dropna()    # (runs averaged)
    assert len(both) >= 12, "no committed rows timing both orders"
    slower = both[both.kq > 1.02 * both.qk]        # (2%: the rounds' spread; the closest cell has kq 0.8% faster)
    assert slower.empty, slower


@pytest.mark.measured
def test_the_e4m3_q_defaults_follow_the_measurements():
    """vLLM's op hands the decode logits its e4m3 q as it is (the fp8 x fp8 dot), and an e4m3 q's 128-key tiles go
    FP8_DOT_TILES to a program: in the committed H100 rows (NOTES.md v58) the e4m3 q is nowhere slower than the
    widened q at the same tile, and two pipelined 128-key tiles nowhere slower than one where 128-key tiles are the
    default (from FP8_SMALL_TILE_MAX_KEYS keys a call)."""
    import pandas as pd

    from glm5lab.kernels.dsa_indexer import FP8_DOT_TILES, FP8_SMALL_TILE_MAX_KEYS

    runs = Path(__file__).resolve().parents[1] / "results" / "h100" / "indexer"
    d = pd.concat([pd.read_csv(runs / "logits_ab.csv"), pd.read_csv(runs / "logits_ab_history.csv.gz")])
    d = d[(d.metric == "logits_time_graph") & (d.dtype == "fp8")]
    d = d.assign(name=d.implementation.str.removeprefix("glm5lab-triton-"))
    t = d.pivot_table(index="shape", columns="name", values="value")            # (runs averaged)
    pairs = [(c, c + "-q8") for c in t.columns if c.endswith("-kq") and c + "-q8" in t.columns]
    assert len(pairs) >= 2, "no committed rows timing the e4m3 q beside the widened q"
    for wide, q8 in pairs:
        both = t[[wide, q8]].dropna()
        assert len(both) >= 9 and (both[q8] <= 1.02 * both[wide]).all(), both   # (2%: the rounds' spread)
    keys = t.index.str.extract(r"B(\d+)_L(\d+)_").astype(int).prod(axis=1).to_numpy()
    big = t[keys >= FP8_SMALL_TILE_MAX_KEYS][["n128w4t1s1-kq-q8", f"n128w4t{FP8_DOT_TILES}s2-kq-q8"]].dropna()
    assert len(big) >= 3 and (big.iloc[:, 1] <= big.iloc[:, 0]).all(), big


def test_topk_ab_script_names_a_bad_before_copy_and_refuses_without_a_gpu(tmp_path, capsys):
    """scripts/topk_ab.py (the before/after of a top-k change, run on the device) fails in one line, writing
    nothing, on a missing or wrong --before file, and on a machine without a GPU."""
    import runpy
    import shutil

    repo = Path(__file__).resolve().parents[1]
    ab = runpy.run_path(str(repo / "scripts" / "topk_ab.py"))["main"]
    out = tmp_path / "ab.csv"
    assert ab(["--before", str(tmp_path / "missing.py"), "--out", str(out)]) == 1
    assert "missing.py: no such file" in capsys.readouterr().err
    (tmp_path / "other.py").write_text("x = 1\n")
    assert ab(["--before", str(tmp_path / "other.py"), "--out", str(out)]) == 1
    assert "has no indexer_topk" in capsys.readouterr().err
    if not torch.cuda.is_available():
        shutil.copy(repo / "glm5lab" / "kernels" / "dsa_indexer.py", tmp_path / "before.py")
        assert ab(["--before", str(tmp_path / "before.py"), "--out", str(out)]) == 1
        assert "GPU" in capsys.readouterr().err
    assert not out.exists()


def test_logits_ab_script_names_a_bad_config_and_refuses_without_a_gpu(tmp_path, capsys):
    """scripts/logits_ab.py (the logits kernel's tile sizes, run on the device) fails in one line, writing nothing, on a
    malformed --configs and on a machine without a GPU."""
    import runpy

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "logits_ab.py"))
    ab, parse = script["main"], script["parse_config"]
    assert parse("128x4:kq:f16") == parse("128x4:f16:kq") == (128, 4, 1, 1, True, True, False, False)
    assert parse("64x4x4x3:qk:pd") == parse("64x4x4x3:pd:qk") == (64, 4, 4, 3, None, False, True, False)
    assert parse("64x4:q8:kq") == (64, 4, 1, 1, None, True, False, True)
    assert parse("64x8") == (64, 8, 1, 1, None, None, False, False)
    assert parse("default:q8") == (None, 4, None, 2, None, None, False, True)         # the kernel's own tiling
    assert script["config_name"](*parse("default:q8")) == "glm5lab-triton-default-q8"
    out = tmp_path / "ab.csv"
    assert ab(["--out", str(out), "--configs", "128x4", "big"]) == 1
    assert "<keys>x<warps>[x<tiles>x<stages>] or default, then [:f16|:bf16][:kq|:qk][:pd][:q8]" in \
        capsys.readouterr().err
    for bad in ("64x4:fp8", "64x4:kq:qk", "64x4:f16:bf16", "64x4:pd:pd", "64x4:q8:f16", "default4:q8", "0x4"):
        assert ab(["--out", str(out), "--configs", bad]) == 1
        assert bad in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert ab(["--out", str(out)]) == 1
        assert "GPU" in capsys.readouterr().err
    assert not out.exists()


def test_prefill_ab_script_names_bad_configs_and_shapes_and_refuses_without_a_gpu(tmp_path, capsys):
    """scripts/prefill_ab.py (the prefill logits' tilings, run on the device) fails in one line, writing nothing, on
    a malformed --configs or --shapes and on a machine without a GPU."""
    import runpy

    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "prefill_ab.py"))
    ab, parse = script["main"], script["parse_config"]
    assert parse("4x64x4:q8") == (4, 64, 4, 1, 2, None, "q8")             # the kernel's dot order
    assert parse("8x128x8x8x3:kq:bf16") == parse("8x128x8x8x3:bf16:kq") == (8, 128, 8, 8, 3, True, "bf16")
    assert parse("default:qk:q8") == (None, None, 4, None, None, False, "q8")   # the kernel's tiling for that order
    assert script["config_name"](*parse("4x128x8x8x2:kq:q8")) == "glm5lab-triton-m4n128w8t8s2-kq-q8"
    assert script["config_name"](*parse("default:qk:bf16")) == "glm5lab-triton-default-qk-bf16"
    assert script["config_name"](*parse("default:bf16")) == "glm5lab-triton-default-bf16"
    out = tmp_path / "ab.csv"
    for bad in ("4x64x4", "4x64:q8", "4x64x4:q8:bf16", "4x64x4:kq:kq:q8", "4x64x4:kq:qk:q8", "4x64x4:mk:q8",
                "0x64x4:q8", "big:q8"):
        assert ab(["--out", str(out), "--configs", bad]) == 1
        err = capsys.readouterr().err
        assert bad in err and "<tokens>x<keys>x<warps>" in err
    for bad in ("1024", "0:16", "64:32", "a:b"):
        assert ab(["--out", str(out), "--shapes", bad]) == 1
        assert "--shapes takes <new tokens>:<context>" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert ab(["--out", str(out)]) == 1
        assert "GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_decode_glm5_shapes(fp8):
    """32 index heads x 128, page 64, contexts up to 8k, k = 2048: logits and top-k sets."""
    gen = torch.Generator().manual_seed(51)
    T, H, D, page, max_len, k = 16, 32, 128, 64, 8192, 2048
    lengths = torch.randint(1, max_len + 1, (T,), generator=gen)
    lengths[:3] = torch.tensor([max_len, 2048, 100])
    q, w, cache, bt, lengths = _paged_case(gen, T=T, H=H, D=D, page=page, num_blocks=T * max_len // page,
                                           max_len=max_len, dtype=torch.bfloat16, fp8=fp8, device="cuda",
                                           lengths=lengths)
    out = torch.full((T, max_len), float("nan"), device="cuda")
    indexer_logits_decode(q, w, cache, bt, lengths, max_len=max_len, out=out)
    flat = dequantize_index_key_cache(cache, D).reshape(-1, D)
    slots = (bt.long()[:, :, None] * page + torch.arange(page, device="cuda")).reshape(T, -1)
    keys = flat[slots]                                                     # [T, max_len, D]
    ref = torch.einsum("thd,tsd->ths", q.double(), keys.double()).relu()
    ref = torch.einsum("th,ths->ts", w.double(), ref)
    ref = ref.masked_fill(torch.arange(max_len, device="cuda")[None] >= lengths[:, None], float("-inf"))
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(out), ~finite)
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0)
    tiled = torch.full((T, max_len), float("nan"), device="cuda")      # several tiles a program, pipelined
    indexer_logits_decode(q, w, cache, bt, lengths, max_len=max_len, out=tiled, block_n=64, tiles=4, num_stages=3)
    assert torch.equal(torch.isneginf(tiled), ~finite)
    torch.testing.assert_close(tiled[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0)
    # both dot orders (keys . q^T: a wgmma on Hopper) at both tiles; for fp8 also the fp16 dot at the large grids'
    # 128-key tiles (its default there), the dot in q's dtype (bf16) forced, and the soft conversion of GPUs before SM89
    variants = [{"block_n": n, "keys_as_m": m} for n in (64, 128) for m in (False, True)]
    if fp8:
        variants += [{"block_n": 128, "f16_dot": False}, {"block_n": 128, "f16_dot": False, "keys_as_m": True},
                     {"f16_dot": True}, {"f16_dot": True, "keys_as_m": True}, {"soft_fp8": True},
                     {"soft_fp8": True, "block_n": 128, "keys_as_m": True}]
    variants += [{"block_n": n, "keys_as_m": m, "permute_d": True} for n in (64, 128) for m in (False, True)]
    cases = [(q, ref[finite], kwargs) for kwargs in variants]
    if fp8:    # an e4m3 q, as vLLM passes it: the fp8 x fp8 dot, against the reference on the e4m3 values
        q8 = q.to(torch.float8_e4m3fn)
        ref8 = torch.einsum("thd,tsd->ths", q8.double(), keys.double()).relu()
        ref8 = torch.einsum("th,ths->ts", w.double(), ref8)[finite]
        cases += [(q8, ref8, {"block_n": n, "keys_as_m": m}) for n in (64, 128) for m in (False, True)]
        cases += [(q8, ref8, {})]
    for q_in, want, kwargs in cases:
        other = torch.full((T, max_len), float("nan"), device="cuda")
        indexer_logits_decode(q_in, w, cache, bt, lengths, max_len=max_len, out=other, **kwargs)
        assert torch.equal(torch.isneginf(other), ~finite), (q_in.dtype, kwargs)
        torch.testing.assert_close(other[finite].double(), want, atol=_tol(torch.bfloat16, ref), rtol=0)
    top = indexer_topk(out, k, lengths)
    assert torch.equal(top, indexer_topk_reference(out, k, lengths))      # exact on its own logits
    assert topk_sets_agree(top, ref, k, lengths, atol=_tol(torch.bfloat16, ref)) == []


@pytest.mark.gpu
def test_gpu_prefill_glm5_shapes_causal():
    gen = torch.Generator().manual_seed(52)
    T, H, D = 1024, 32, 128
    q = torch.randn(T, H, D, generator=gen).bfloat16().cuda()
    w = (torch.randn(T, H, generator=gen) / H).cuda()
    k = torch.randn(T, D, generator=gen).bfloat16().cuda()
    ks = torch.zeros(T, dtype=torch.int32, device="cuda")
    ke = torch.arange(1, T + 1, dtype=torch.int32, device="cuda")
    out = indexer_logits_prefill(q, w, k, ks, ke)
    ref = indexer_logits_reference(q, k, w, ke, compute_dtype=torch.float64)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(out), ~finite)
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0)
    top = indexer_topk(out, 512, ke)
    assert torch.equal(top, indexer_topk_reference(out, 512, ke))
    # vLLM's fp8 path: keys gathered from the fp8 cache as (e4m3, scale), q in e4m3 with its scale a (token, head)
    # folded into the weights -- the fp8 x fp8 dot; a bf16 q against the same keys converts them in the kernel
    values, scales = quantize_keys_fp8(k)
    amax = q.float().abs().amax(dim=-1)
    q_scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q8 = (q.float() / q_scale[..., None]).to(torch.float8_e4m3fn)
    keys = values.double() * scales.double()[:, None]
    # (and the tilings scripts/prefill_ab.py times: both dot orders, 8 warps, 256 q rows, tiles a program)
    tilings = ({}, {"keys_as_m": True}, {"keys_as_m": False},
               {"block_m": 8, "block_n": 128, "num_warps": 8, "keys_as_m": True, "tiles": 8},
               {"block_m": 4, "block_n": 128, "num_warps": 8, "tiles": 4})
    for q_in, w_in in ((q8, w * q_scale), (q, w)):
        ref = indexer_logits_reference(q_in.float(), keys, w_in, ke, compute_dtype=torch.float64)
        for tiling in tilings:
            out = indexer_logits_prefill(q_in, w_in, (values, scales), ks, ke, **tiling)
            assert torch.equal(torch.isneginf(out), ~finite), (q_in.dtype, tiling)
            torch.testing.assert_close(out[finite].double(), ref[finite], atol=_tol(torch.bfloat16, ref), rtol=0,
                                       msg=lambda m: f"{q_in.dtype} {tiling}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", TOPK_METHODS)
@pytest.mark.parametrize("columns", [65536, 16384, 3001])
def test_gpu_topk_large_rows_with_ties(method, columns):
    """GLM-5's top-k 2048 over long rows (hist streams 64k and 16k; keeps 3001 in registers)."""
    gen = torch.Generator().manual_seed(53)
    logits = torch.randn(64, columns, generator=gen).cuda()
    logits[1] = torch.randint(0, 50, (columns,), generator=gen).float().cuda()   # heavy ties
    lengths = torch.randint(1, columns + 1, (64,), generator=gen).cuda()
    lengths[:2] = columns
    top = indexer_topk(logits, 2048, lengths, method=method)
    ref = indexer_topk_reference(logits, 2048, lengths)
    assert torch.equal(top, ref)
    assert torch.equal(indexer_topk(logits[:2], 2048, lengths[:2], method=method), ref[:2])   # batch of 2
    if method == "split":   # another block than the default (the CPU interpreter accepts code that does not compile)
        assert torch.equal(indexer_topk(logits[:2], 2048, lengths[:2], method=method, block=256), ref[:2])
