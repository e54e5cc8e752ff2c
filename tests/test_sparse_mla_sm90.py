"""The Gluon fp8_ds_mla kernel (glm5lab.kernels.sparse_mla_sm90, `_config={"impl": "gluon"}`) against the float64
reference, under the same tolerances as the Triton kernel (tests/test_sparse_mla_kernel.py's docstring): it runs the
same fp16-domain arithmetic as the "f16" path. No interpreter runs Gluon, so the numeric tests are GPU tests (the
H200 run); without a GPU this file checks the refusal and the kernel's sm90 build."""
import collections
import re
import tempfile
from pathlib import Path

import pytest
import torch

from glm5lab.errors import Glm5labError
from glm5lab.kernels import sparse_mla_sm90
from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla
from glm5lab.kernels.sparse_mla import sparse_mla_attention
from glm5lab.sparse.reference import sparse_mla_reference
from tests import offline_build
from tests.seeds import fresh_seed
from tests.test_sparse_mla_kernel import SCALE, UNIT, _raw_fp8_case, check, make_case, run_poisoned

ROOT = Path(__file__).resolve().parents[1]


def sparse_mla_default_is_gluon(H: int) -> bool:
    from glm5lab.kernels.sparse_mla import _gluon_by_default

    q = torch.zeros(1, H, 576, dtype=torch.bfloat16, device="cuda")
    return (_gluon_by_default(q, True, H, "auto", None) and not _gluon_by_default(q, True, H, "fused", None)
            and not _gluon_by_default(q, True, H, "auto", {"impl": "triton"}))
GLUON = {"impl": "gluon"}


def test_gluon_kernel_refuses_what_it_does_not_run_with_a_reason(device):
    q, cache, slots, _ = make_case(2, 8, 40, 100, torch.bfloat16, "fp8_ds_mla", device)
    if device == "cpu":
        with pytest.raises(Glm5labError, match="no interpreter runs Gluon"):
            sparse_mla_attention(q, cache, slots, SCALE, _config=GLUON)
    with pytest.raises(Glm5labError, match=r"head count must be 1..128, got 129"):
        q129, c129, s129, _ = make_case(1, 129, 40, 100, torch.bfloat16, "fp8_ds_mla", device)
        sparse_mla_attention(q129, c129, s129, SCALE, _config=GLUON)
    with pytest.raises(Glm5labError, match="fp8_ds_mla kernel takes bf16 q"):
        sparse_mla_attention(q.half(), cache, slots, SCALE, _config=GLUON)


def _sm90_build(_sass=False, **consts) -> dict:
    """scripts/sass_report.py's report of a Gluon build for sm_90 (offline); _sass: with its instructions in
    program order (predicates dropped) under "_sass"."""
    cfg = {"gluon": True, "BLOCK_H": 16, "BLOCK_N": 32, "STAGES": 2, "SPLIT": True, **consts}
    with tempfile.TemporaryDirectory() as dump:
        (line,) = offline_build.sass_report(cfg, dump=dump if _sass else None)
        assert "error" not in line, line["error"]
        if _sass:
            text = (Path(dump) / "config0" / "sass.txt").read_text()
            line["report"]["_sass"] = [re.sub(r"^@!?U?P\w+\s+", "", t)
                                       for t in re.findall(r"/\*[0-9a-f]+\*/\s+(.*?);", text)]
            line["report"]["_sass_at"] = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]+)\*/\s+(.*?);", text)]
    return line["report"]


def test_gluon_sm90_build_pipelines_the_gathers_without_spilling():
    """The properties the H200 numbers rest on (NOTES.md v7): the main loop issues cp.async gathers (LDGSTS) and
    waits on an earlier group (DEPBAR), converts e4m3 pairs (F2FP), runs mma.sync with ldmatrix operands, no
    local-memory spill, 4 barriers a step, and two CTAs fit an SM with 2 stages (<= 113 KB of shared memory)."""
    rep = _sm90_build()
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["LDGSTS"] > 0 and rep["HMMA"] == 68 and rep["LDSM"] > 0 and rep["F2FP"] > 0
    assert rep["BAR"] <= 4
    assert rep["smem"] <= 113 * 1024


def test_gluon_fp8_sm90_build_requests_the_first_rows_before_staging_q():
    """NOTES.md v23: a small-batch program is little more than its start, so the first gathers (LDGSTS) are issued
    before q is staged -- before its per-head maximum (SHFL.BFLY) and before any CTA barrier -- and q's loads are in
    flight beside them. (v22's build staged q first: its first LDGSTS came after the max and three barriers, one
    round trip later; 9.1 against 8.6 us at 1 token x 8 heads on the H200.)"""
    ins = _sm90_build(_sass=True)["_sass"]

    def first(prefix):
        return next(i for i, x in enumerate(ins) if x.startswith(prefix))

    assert first("LDGSTS") < first("SHFL.BFLY") and first("LDGSTS") < first("BAR.SYNC")
    assert first("LDG.E.128") < first("SHFL.BFLY")            # (q's latent loads, 16 bytes a thread)


@pytest.mark.parametrize("kernel", [{}, {"FP8": False}, {"rows": True, "BLOCK_N": 64},
                                    {"rows": True, "BLOCK_N": 64, "FP8": False}],
                         ids=["fp8_mma_sync", "16bit_mma_sync", "fp8_rows", "16bit_rows"])
def test_gluon_small_batch_builds_let_the_merge_launch_from_their_start_only_with_pdl(kernel):
    """PDL=True (the merge launched early): the kernel lets the dependent grid launch (griddepcontrol.launch_dependents
    = SASS PREEXIT) once, at its start: no global load and no barrier on the straight-line code that leads to it (the
    rows-as-M fp8 kernel is warp-specialized: its consumer warps branch to their own code first, and it is there),
    so the merge's programs can be resident and waiting while the attention runs. Without PDL there is none."""
    ins = [x.strip() for x in _sm90_build(_sass=True, PDL=True, **kernel)["_sass"]]
    assert ins.count("PREEXIT") == 1
    at = ins.index("PREEXIT")
    start = max((i + 1 for i in range(at) if ins[i].startswith(("BRA", "EXIT")) or " BRA " in f" {ins[i]}"),
                default=0)
    assert not [x for x in ins[start:at] if x.startswith(("LDG", "LDGSTS", "BAR"))], ins[start:at]
    assert "PREEXIT" not in [x.strip() for x in _sm90_build(_sass=True, **kernel)["_sass"]]


def test_gluon_16bit_sm90_build_reads_the_ring_without_conversions():
    """The bf16-cache kernel: no dequantization (no e4m3 conversion, 8 F2FP at most: P's packing), both products
    through ldmatrix, cp.async in the loop, no spill, <= 3 barriers a step, two CTAs a SM."""
    rep = _sm90_build(FP8=False)
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0 and rep["HMMA"] == 68 and rep["LDSM"] > 0
    assert rep["LDGSTS"] > 0 and rep.get("F2FP", 0) <= 8 and rep["BAR"] <= 3
    assert rep["smem"] <= 113 * 1024


# ------------------------------------------------------------------------------------------------ on the GPU

WS8 = sparse_mla_sm90.ROWS_FP8_CONFIG     # the warp-specialized rows-as-M fp8_ds_mla kernel (NOTES.md v9), forced
# ... its dual-consumer form (NOTES.md v17), O^T's products async (v19), P^T against the kept max (v31: the default)
WS8X2OKP = sparse_mla_sm90.ROWS_FP8_DUAL_CONFIG    # ... P^T's tiles re-derived each step (pipe "p": the default, v35)
WS8X2OK = {**WS8X2OKP, "pipe": "o"}             # ... v31-v34's form
WS8X2O = {**WS8X2OK, "kept_p": False}           # ... without the kept max (v19-v30)
WS8X2 = {**WS8X2O, "pipe": ""}                  # ... and v17's form
WS8X2SOKP = {**sparse_mla_sm90.ROWS_FP8_DUAL_DEEP_CONFIG, "pipe": "sop"}   # ... S^T's too (the default, v35-v39)
WS8X2SOK = {**WS8X2SOKP, "pipe": "so"}                   # ... v34's form
VARIANT_CFGS = [{**sparse_mla_sm90.DEFAULT_CONFIG, "stages": 2}, {**sparse_mla_sm90.DEFAULT_CONFIG, "stages": 3}, WS8,
                WS8X2, WS8X2O, WS8X2OK]
VARIANT_IDS = ["s2", "s3", "ws8", "ws8x2", "ws8x2o", "ws8x2ok"]
BOTH_FP8 = pytest.mark.parametrize("fp8_cfg", [GLUON, WS8, WS8X2, WS8X2O, WS8X2OK, WS8X2SOK, WS8X2SOKP, WS8X2OKP],
                                   ids=["default", "ws8", "ws8x2", "ws8x2o", "ws8x2ok", "ws8x2sok", "ws8x2sokp",
                                        "ws8x2okp"])
# ... its 8-head tile (<= 8 heads), a persistent kernel (NOTES.md v18) with its products issued async, two at a time
# (the default in v19-v35, v18 call 10), and without (WS8X2P, v18's form); since v36 no default (WS8X2ESOPK below)
WS8X2PP = sparse_mla_sm90.ROWS_FP8_PERSISTENT_CONFIG
WS8X2P = {**WS8X2PP, "pipe": ""}
# ... with three products in flight on both sides (the default once the top-k was not split, v20-v35)
WS8X2PP3P = sparse_mla_sm90.ROWS_FP8_PERSISTENT_DEEP_CONFIG      # (P^T's tiles re-derived each step since v35)
WS8X2PP3 = {**WS8X2PP3P, "pipe": "s3o3"}
# ... both with P^T against the kept max (NOTES.md v31)
WS8X2PPK, WS8X2PP3K = {**WS8X2PP, "kept_p": True}, {**WS8X2PP3, "kept_p": True}
WS8X2PP3KP = {**WS8X2PP3K, "pipe": "s3o3p"}       # ... P^T's tiles re-derived each step (NOTES.md v35)
# the fp8 tiles a test at <= 8 heads takes: the 8-head ones too
FP8_AT_8_HEADS = pytest.mark.parametrize(
    "fp8_cfg", [GLUON, WS8, WS8X2, WS8X2O, WS8X2P, WS8X2PP, WS8X2PP3, WS8X2OK, WS8X2PPK, WS8X2PP3K, WS8X2SOK,
                WS8X2PP3KP, WS8X2SOKP, WS8X2PP3P, WS8X2OKP],
    ids=["default", "ws8", "ws8x2", "ws8x2o", "ws8x2p", "ws8x2pp", "ws8x2pp3", "ws8x2ok", "ws8x2ppk", "ws8x2pp3k",
         "ws8x2sok", "ws8x2pp3kp", "ws8x2sokp", "ws8x2pp3p", "ws8x2okp"])
# the persistent 8-head tile's v19-v35 default forms: two products in flight, three (unsplit calls); and with the
# kept max
PERSISTENT_DEFAULTS = pytest.mark.parametrize("pcfg", [WS8X2PP, WS8X2PP3, WS8X2PPK, WS8X2PP3K, WS8X2PP3P],
                                              ids=["ws8x2pp", "ws8x2pp3", "ws8x2ppk", "ws8x2pp3k", "ws8x2pp3p"])


@pytest.mark.gpu
@pytest.mark.parametrize("vcfg", VARIANT_CFGS, ids=VARIANT_IDS)
@pytest.mark.parametrize("H", [5, 8, 16])
@pytest.mark.parametrize("T", [1, 8, 130])
def test_gpu_gluon_real_shapes(vcfg, H, T):
    """Top-k 2048 over 65,536 slots (block 64), bf16 q, default splits (column merge); agrees with the Triton
    kernel's f16 path within the element bound too."""
    assert sparse_mla_default_is_gluon(H)
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots, _config={**GLUON, **vcfg})
    check(out, lse, ref, torch.bfloat16)
    base, _ = run_poisoned(q, cache, slots, _config={"impl": "triton"})
    assert float((out.float() - base.float()).abs().max()) <= 8 * UNIT[torch.bfloat16] * float(base.float().abs().max())


@pytest.mark.gpu
@FP8_AT_8_HEADS
@pytest.mark.parametrize("topk,splits", [(512, 1), (1000, 3), (1000, 1), (77, 5), (2048, 64)])
def test_gpu_gluon_odd_topk_and_forced_splits(fp8_cfg, topk, splits):
    """Top-k not a multiple of the 32/64-row step, a split boundary inside a step, more splits than steps allow."""
    q, cache, slots, ref = make_case(6, 8, topk, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config=fp8_cfg)
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@PERSISTENT_DEFAULTS
@pytest.mark.parametrize("H", [5, 8])
@pytest.mark.parametrize("T", [1, 8, 130])
def test_gpu_gluon_8_head_tiles_real_shapes(H, T, pcfg):
    """The dual-consumer kernel's 8-head tile (wgmma N = 8; P stored [heads, rows] and read transposed; persistent):
    real shapes as test_gpu_gluon_real_shapes, within its <= 8 heads."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots, _config={**GLUON, **pcfg})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@PERSISTENT_DEFAULTS
def test_gpu_gluon_8_head_tiles_every_byte_pattern_all_invalid_tokens_and_cuda_graph(pcfg):
    q, cache, slots, ref = _raw_fp8_case("cuda", T=5, H=8, topk=512, num_slots=4096)
    out, lse = run_poisoned(q, cache, slots, _config={**GLUON, **pcfg})
    check(out, lse, ref, torch.bfloat16)
    q, cache, slots, ref = make_case(5, 8, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    slots[0] = -1
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), torch.where(slots >= 65536, -1, slots), SCALE)
    _check_cuda_graph_replay(q, cache, slots, tuple(x.cpu() for x in ref), pcfg)
    q16, cache16, slots16, _ = make_case(2, 16, 512, 4096, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    with pytest.raises(Glm5labError, match="8-head tile takes calls of <= 8 heads, got 16"):
        sparse_mla_attention(q16, cache16, slots16, SCALE, _config=pcfg)


@pytest.mark.gpu
@pytest.mark.parametrize("pcfg", [WS8X2P, WS8X2PP, WS8X2PP3, WS8X2PP3K, WS8X2PP3P],
                         ids=["ws8x2p", "ws8x2pp", "ws8x2pp3", "ws8x2pp3k", "ws8x2pp3p"])
@pytest.mark.parametrize("T,topk,splits", [(400, 2048, 1), (150, 2000, 3), (97, 77, 5), (300, 130, 1)])
def test_gpu_gluon_persistent_kernel_walks_many_items_a_program(T, topk, splits, pcfg):
    """The persistent 8-head kernel (NOTES.md v18) with several (token, split) items a program: an odd number of
    steps an item (the consumers' parities swap from item to item), splits of unequal length, items of one or two
    steps, an all-invalid token; the poisoned outputs are all written and match the float64 reference."""
    q, cache, slots, ref = make_case(T, 8, topk, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    assert T * splits > torch.cuda.get_device_properties(0).multi_processor_count
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config={**GLUON, **pcfg})
    check(out, lse, ref, torch.bfloat16)


# the dual kernel's 8-head tile one item a program (not persistent, NOTES.md v36), "sop" with the kept max (the default
# at <= 8 heads from 16 tokens since v36) and without, "s3o3p"
WS8X2ESOPK = sparse_mla_sm90.ROWS_FP8_DUAL_8_CONFIG
WS8X2ESOP = {**WS8X2ESOPK, "kept_p": False}
WS8X2ESOPFHK = {**WS8X2ESOPK, "pipe": "sopfh"}              # (the shorter step, NOTES.md v40; no default at 8 heads)
WS8X2ES3O3P = {**WS8X2PP3P, "one_item": True}


@pytest.mark.gpu
@pytest.mark.parametrize("pcfg", [WS8X2ESOPK, WS8X2ESOP, WS8X2ES3O3P, WS8X2ESOPFHK],
                         ids=["ws8x2esopk", "ws8x2esop", "ws8x2es3o3p", "ws8x2esopfhk"])
@pytest.mark.parametrize("H,T,topk,splits", [(8, 200, 2048, 1), (6, 150, 2000, 3), (8, 97, 77, 5), (8, 8, 2048, 0),
                                             (3, 1, 2048, 0), (8, 300, 130, 1)])
def test_gpu_gluon_dual_8_head_tile_one_item_a_program(H, T, topk, splits, pcfg):
    """The dual-consumer kernel on 8-head tiles, one (token, split) a program: odd steps, unequal splits, items of one
    or two steps, default splits at small batches; the poisoned outputs all written and matching the float64
    reference; every e4m3 byte pattern."""
    _check_tile_cases(pcfg, (H,), T, topk, splits)


def _check_tile_cases(pcfg, heads, T, topk, splits):
    """A tile's calls of T tokens and each head count in heads (splits 0: the default's), then every e4m3 byte
    pattern at 8 heads; each output poisoned first and checked against the float64 reference."""
    for H in heads:
        q, cache, slots, ref = make_case(T, H, topk, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
        out, lse = run_poisoned(q, cache, slots, num_splits=splits or None, _config={**GLUON, **pcfg})
        check(out, lse, ref, torch.bfloat16)
    q, cache, slots, ref = _raw_fp8_case("cuda", T=5, H=8, topk=512, num_slots=4096)
    out, lse = run_poisoned(q, cache, slots, _config={**GLUON, **pcfg})
    check(out, lse, ref, torch.bfloat16)


# the dual kernel's step on one consumer, two CTAs a SM (NOTES.md v38): the 8-head tile "sop" + kept and "s3o3p", the
# 16-head tile "sop" + kept
# (the v38-v40 forms: 64-bit row offsets in the loader, as named here; the 16-head default takes 32-bit ones (v41))
PAIR8SOPK = {**sparse_mla_sm90.ROWS_FP8_PAIRED_8_CONFIG, "offs32": False}   # (the <= 8-head default in v38-v40)
PAIR8S3O3P = {**WS8X2ES3O3P, "stages": 2, "resident": 2, "paired": True}
PAIR16SOPK = {**sparse_mla_sm90.ROWS_FP8_PAIRED_CONFIG, "pipe": "sop", "offs32": False}   # (9-16 heads, v38-v39)
# ... and both with the shorter step (NOTES.md v40: "f" q's rope part staged times its multiplier, "h" P^T scaled in
# fp16 pairs; the 16-head tile's default since), the dual 16-head tile with "h" (its default since)
PAIR8SOPFHK = {**PAIR8SOPK, "pipe": "sopfh"}
PAIR16SOPFHK = {**sparse_mla_sm90.ROWS_FP8_PAIRED_CONFIG, "offs32": False}
WS8X2SOKPH = sparse_mla_sm90.ROWS_FP8_DUAL_DEEP_CONFIG
# ... and with the loader's row offsets in 32 bits (NOTES.md v40; the 16-head default's "auto" takes them, v41)
PAIR8SOPK32, PAIR16SOPFHK32 = {**PAIR8SOPK, "offs32": True}, {**PAIR16SOPFHK, "offs32": True}
PAIRED = pytest.mark.parametrize("pcfg", [PAIR8SOPK, PAIR8S3O3P, PAIR16SOPK, PAIR8SOPFHK, PAIR16SOPFHK, PAIR8SOPK32,
                                          PAIR16SOPFHK32],
                                 ids=["pair8sopk", "pair8s3o3p", "pair16sopk", "pair8sopfhk", "pair16sopfhk",
                                      "pair8sopk32", "pair16sopfhk32"])


def test_offs32_is_refused_where_it_does_not_apply():
    """The loader's 32-bit row offsets (offs32) are the paired kernel's option, for a cache of < 2^31 elements: on
    another kernel, or with a larger cache, launch says so before anything is built."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90
    big = torch.empty(2**31, dtype=torch.uint8, device="meta")
    args = (None, big) + (None,) * 18
    with pytest.raises(Glm5labError, match=r"offs32=True needs a cache of < 2\^31 elements"):
        sm90.launch((1, 1, 1), args, PAIR16SOPFHK32, False, True, num_heads=16)
    with pytest.raises(Glm5labError, match="offs32=True: only the paired fp8_ds_mla kernel takes it"):
        sm90.launch((1, 1, 1), args, {**WS8X2SOKPH, "offs32": True}, False, True, num_heads=16)


def test_offs32_auto_takes_32_bit_offsets_where_the_kernel_and_the_cache_allow():
    """The paired 16-head default's "auto" (NOTES.md v41): the paired kernel with a cache of < 2^31 elements gets
    32-bit row offsets; a larger cache (a vLLM cache of every layer in one tensor) or another kernel laid over the
    default gets the 64-bit ones, without an error; the 8-head default and the forms named with False never."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90
    small = torch.empty(2**31 - 1, dtype=torch.uint8, device="meta")
    big = torch.empty(2**31, dtype=torch.uint8, device="meta")
    paired = sm90.kernel_of_config(sm90.ROWS_FP8_PAIRED_CONFIG, True)
    dual = sm90.kernel_of_config(WS8X2SOKPH, True)
    assert sm90.ROWS_FP8_PAIRED_CONFIG["offs32"] == "auto"            # (the 8-head tile's: False, v41 call 5)
    assert not sm90.loader_offs32(sm90.ROWS_FP8_PAIRED_8_CONFIG, paired, small)
    assert sm90.loader_offs32(sm90.ROWS_FP8_PAIRED_CONFIG, paired, small)
    assert not sm90.loader_offs32(sm90.ROWS_FP8_PAIRED_CONFIG, paired, big)
    assert not sm90.loader_offs32({**WS8X2SOKPH, "offs32": "auto"}, dual, small)
    assert not sm90.loader_offs32(PAIR16SOPFHK, paired, small) and sm90.loader_offs32(PAIR16SOPFHK32, paired, small)


@pytest.mark.gpu
@PAIRED
@pytest.mark.parametrize("H,T,topk,splits", [(8, 300, 2048, 1), (6, 150, 2000, 3), (8, 97, 77, 5), (8, 8, 2048, 0),
                                             (3, 1, 2048, 0), (8, 300, 130, 1), (7, 128, 2048, 0)])
def test_gpu_gluon_paired_tile(H, T, topk, splits, pcfg):
    """The paired kernel (one consumer, two CTAs a SM): more programs than CTA slots, odd steps, unequal splits, items
    of one or two steps, default splits; the poisoned outputs all written and matching the float64 reference; every
    e4m3 byte pattern; the 16-head tile at 16 heads too."""
    _check_tile_cases(pcfg, (H, 16) if pcfg["block_h"] == 16 else (H,), T, topk, splits)


def _consumer_moves(step_max):
    """How far each dual consumer's running maximum rises from one of its steps to its next (steps i and i + 2:
    the two consumers take alternate steps), finite rises only: [..., steps - 2]."""
    run = step_max.cummax(dim=-1).values
    rise = run[..., 2:] - run[..., :-2]
    return rise[torch.isfinite(rise)]


@pytest.mark.gpu
@pytest.mark.parametrize("pcfg", [WS8X2PP, WS8X2PP3, WS8X2PPK, WS8X2PP3K, WS8X2O, WS8X2OK, WS8X2SOK, WS8X2PP3KP,
                                  WS8X2SOKP, WS8X2OKP, WS8X2PP3P, WS8X2ESOPK, WS8X2ES3O3P, PAIR8SOPK, PAIR16SOPK,
                                  PAIR8SOPFHK, PAIR16SOPFHK, WS8X2SOKPH],
                         ids=["ws8x2pp", "ws8x2pp3", "ws8x2ppk", "ws8x2pp3k", "ws8x2o", "ws8x2ok", "ws8x2sok",
                              "ws8x2pp3kp", "ws8x2sokp", "ws8x2okp", "ws8x2pp3p", "ws8x2esopk", "ws8x2es3o3p",
                              "pair8sopk", "pair16sopk", "pair8sopfhk", "pair16sopfhk", "ws8x2sokph"])
@pytest.mark.parametrize("spread", [1.0, 16.0], ids=["q-as-drawn", "q-16x"])
def test_gpu_gluon_8_head_tiles_rows_sorted_by_score(pcfg, spread):
    """One split a token (32 steps, 16 a consumer), each token's rows in order of their score summed over the heads,
    rising (the running max moves at most steps, so O^T is rescaled there; with q as drawn some of a consumer's moves
    stay within the kept max's threshold of 8 in log2 units, with q 16 times larger some pass it, so that P^T against
    the kept max (NOTES.md v31) is redone on later steps -- both asserted on the data --, and lse's tolerance grows
    with its size) and falling (only at the first): the dual-consumer forms (8 heads persistent, 16 heads) match
    the reference."""
    H = 16 if pcfg.get("block_h") == 16 else 8
    q, cache, slots, _ = make_case(6, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    q = (q.float() * spread).to(torch.bfloat16)
    kv = dequantize_fp8_ds_mla(cache).view(-1, 576).float()
    rows = kv[slots.clamp(0, kv.shape[0] - 1).long()]
    score = torch.einsum("thd,tkd->tk", q.float(), rows)                                         # (all heads)
    rising = torch.gather(slots, 1, score.argsort(dim=1))
    per_head = torch.einsum("thd,tkd->thk", q.float(), kv[rising.clamp(0, kv.shape[0] - 1).long()])
    valid = ((rising >= 0) & (rising < kv.shape[0]))[:, None, :]
    per_head = torch.where(valid, per_head * SCALE * 1.4426950408889634, float("-inf"))   # log2 units, as the kernel
    rises = _consumer_moves(per_head.view(6, H, 32, 64).amax(dim=3))
    if spread == 1.0:
        assert bool(((rises > 0) & (rises <= 8)).any()), "no kept move: the common path's moves go untested"
    else:
        assert int((rises > 8).sum()) >= 8, "too few moves past the threshold: the rare path goes untested"
    for ordered in (rising, rising.flip(1).contiguous()):
        ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), torch.where(ordered >= 65536, -1, ordered), SCALE)
        out, lse = run_poisoned(q, cache, ordered, num_splits=1, _config={**GLUON, **pcfg})
        check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16, lse_rel=0.0 if spread == 1.0 else 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("pcfg", [WS8X2PP3, WS8X2PP3K, WS8X2O, WS8X2OK, WS8X2SOK, WS8X2PP3KP, WS8X2SOKP, WS8X2OKP,
                                  WS8X2PP3P, PAIR8SOPK, PAIR16SOPK],
                         ids=["ws8x2pp3", "ws8x2pp3k", "ws8x2o", "ws8x2ok", "ws8x2sok", "ws8x2pp3kp", "ws8x2sokp",
                              "ws8x2okp", "ws8x2pp3p", "pair8sopk", "pair16sopk"])
def test_gpu_gluon_dual_tiles_rows_sorted_by_scale(pcfg):
    """One split a token (32 steps, 16 a consumer), each token's rows in order of their chunk scales, which grow 4x
    a 64-row step (1e-6 to ~1e13 over 32 steps): r, the unit O^T is kept in, rises ~16x from one of a consumer's steps
    to its next -- with P^T against the kept max (NOTES.md v31) past its slack of 16 on some steps (P^T redone),
    within it on others (kept), both asserted on the data; the dual-consumer forms match the reference."""
    H = 16 if pcfg.get("block_h") == 16 else 8
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    num_slots, T, topk = 4096, 3, 2048
    cache = torch.randint(0, 256, (num_slots, 656), generator=g, dtype=torch.uint8)
    cache[:, :512][(cache[:, :512] & 0x7F) == 0x7F] = 0x3C
    step = torch.arange(num_slots) // 64 % 32                               # slot k's step when taken in order
    scales = 1e-6 * 4.0 ** step.double()[:, None] * (1 + torch.rand(num_slots, 4, generator=g, dtype=torch.float64))
    cache[:, 512:528] = scales.float().contiguous().view(torch.uint8)
    cache[:, 528:] = (torch.randn(num_slots, 64, generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    q = (torch.randn(T, H, 576, generator=g) * 3e-15).to(torch.bfloat16)   # (scores ~1 at the largest scales)
    slots = ((torch.arange(topk)[None, :] + topk * torch.arange(T)[:, None]) % num_slots).to(torch.int32)
    step_r = scales.float()[slots.long()].amax(dim=2).view(T, 32, 64).amax(dim=2).double()
    ratio = step_r[:, 2:] / step_r[:, :-2].cummax(dim=1).values
    assert bool((ratio > 16).any()) and bool(((ratio > 1) & (ratio <= 16)).any()), f"seed {seed}: r's cases"
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), slots, SCALE)
    out, lse = run_poisoned(q.cuda(), cache.cuda(), slots.cuda(), num_splits=1, _config={**GLUON, **pcfg})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("vcfg", VARIANT_CFGS, ids=VARIANT_IDS)
def test_gpu_gluon_every_byte_pattern(vcfg):
    q, cache, slots, ref = _raw_fp8_case("cuda", T=5, H=16, topk=512, num_slots=4096)
    out, lse = run_poisoned(q, cache, slots, _config={**GLUON, **vcfg})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@FP8_AT_8_HEADS
def test_gpu_gluon_skipped_rows_are_never_read(fp8_cfg):
    """Slots -1 and beyond the cache are not read (zero-filled copies): the row they would fall back to (slot 0)
    holds NaN bytes and scales, and no valid slot points at it, so a read of it would poison the output."""
    q, cache, slots, _ = make_case(4, 8, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    slots[slots == 0] = 1
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), torch.where(slots >= 65536, -1, slots), SCALE)
    flat = cache.view(-1, 656)                       # poisoned after the reference (which reads row 0 for -1)
    flat[0, :512] = 0x7F                                                   # e4m3 NaN
    flat[0, 512:528] = torch.tensor([float("nan")] * 4, device="cuda").view(torch.uint8)
    out, lse = run_poisoned(q, cache, slots, _config=fp8_cfg)
    check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16)


@pytest.mark.gpu
@FP8_AT_8_HEADS
@pytest.mark.parametrize("q_mag,scale_range", [(3e4, (1e-8, 1e-6)), (1e-6, (1e2, 1e4))],
                         ids=["q-beyond-fp16-tiny-scales", "q-below-fp16-normals-large-scales"])
def test_gpu_gluon_q_and_scale_ranges(fp8_cfg, q_mag, scale_range):
    """As the f16 path's range test: q beyond / below fp16's range, chunk scales spanning 100x at 1e-8 or 1e2."""
    _check_range_case(fp8_cfg, q_mag, scale_range)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_cfg", [PAIR8SOPK, PAIR16SOPK, PAIR8SOPFHK, PAIR16SOPFHK, WS8X2SOKPH],
                         ids=["pair8sopk", "pair16sopk", "pair8sopfhk", "pair16sopfhk", "ws8x2sokph"])
@pytest.mark.parametrize("q_mag,scale_range", [(3e4, (1e-8, 1e-6)), (1e-6, (1e2, 1e4))],
                         ids=["q-beyond-fp16-tiny-scales", "q-below-fp16-normals-large-scales"])
def test_gpu_gluon_paired_and_short_step_q_and_scale_ranges(fp8_cfg, q_mag, scale_range):
    """The range test on the paired tiles and the shorter step's forms (NOTES.md v40): with "f" q's rope part is
    staged times q's multiplier (here 2^-2 .. 2^32), with "h" P^T's chunk scales over r are rounded to fp16."""
    _check_range_case(fp8_cfg, q_mag, scale_range)


def _check_range_case(fp8_cfg, q_mag, scale_range):
    """One range case (`_range_case`, 8 heads) of a tile against the float64 reference, the output poisoned first."""
    q, cache, slots = _range_case(q_mag, scale_range, H=8)
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), slots, SCALE)
    out, lse = run_poisoned(q.cuda(), cache.cuda(), slots.cuda(), _config=fp8_cfg)
    check(out, lse, ref, torch.bfloat16)


def _range_case(q_mag, scale_range, H, T=3, num_slots=4096, topk=512):
    """CPU (q, cache, slots) of the range tests: random e4m3 bytes (no NaN), chunk scales log-uniform in
    scale_range, rope values ~0.1, q's latent part of magnitude q_mag (its rope part ~1)."""
    import math

    g = torch.Generator().manual_seed(fresh_seed())
    cache = torch.randint(0, 256, (num_slots, 656), generator=g, dtype=torch.uint8)
    cache[:, :512][(cache[:, :512] & 0x7F) == 0x7F] = 0x3C
    lo, hi = math.log(scale_range[0]), math.log(scale_range[1])
    cache[:, 512:528] = torch.exp(lo + (hi - lo) * torch.rand(num_slots, 4, generator=g)).contiguous().view(torch.uint8)
    cache[:, 528:] = (torch.randn(num_slots, 64, generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    q = (torch.randn(T, H, 576, generator=g) * q_mag).to(torch.bfloat16)
    q[..., 512:] = torch.randn(T, H, 64, generator=g).to(torch.bfloat16)
    return q, cache, torch.randint(0, num_slots, (T, topk), generator=g, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_gpu_cache_off_16_byte_alignment_runs_the_triton_kernel(layout):
    """The Gluon kernels copy rows in 16-byte pieces (v10 call 1: a cache 4 bytes off that alignment failed deep
    inside Triton's build): such a cache runs the Triton kernel by default, and a forced Gluon call names why not."""
    from glm5lab.kernels.sparse_mla import kernel_for

    q, cache, slots, ref = make_case(3, 8, 1000, 4096, torch.bfloat16, layout, "cuda", block_size=64)
    buf = torch.empty(cache.numel() + 16, dtype=cache.dtype, device="cuda")
    moved = buf[2:2 + cache.numel()].view(cache.shape) if layout == "bf16" else buf[4:4 + cache.numel()].view(
        cache.shape)
    moved.copy_(cache)
    assert moved.data_ptr() % 16 == 4
    assert kernel_for(8, layout, torch.bfloat16, (9, 0), kv_cache=moved) == "triton"
    assert kernel_for(8, layout, torch.bfloat16, (9, 0), kv_cache=cache) == "gluon"
    out, lse = run_poisoned(q, moved, slots)
    check(out, lse, ref, torch.bfloat16)
    with pytest.raises(Glm5labError, match="16-byte boundary .* address % 16 = 4"):
        sparse_mla_attention(q, moved, slots, SCALE, _config=WS8 if layout == "fp8_ds_mla" else GLUON)


@pytest.mark.gpu
@BOTH_FP8
def test_gpu_gluon_all_invalid_tokens_and_cuda_graph(fp8_cfg):
    """Tokens with no valid slot give out 0 / lse -inf; the kernel and its merge replay in a CUDA graph."""
    q, cache, slots, ref = make_case(5, 16, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    slots[0] = -1
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), torch.where(slots >= 65536, -1, slots), SCALE)
    _check_cuda_graph_replay(q, cache, slots, tuple(x.cpu() for x in ref), fp8_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("H,T", [(8, 1), (16, 2), (5, 1)])
def test_gpu_gluon_default_early_merge_replays_in_cuda_graph(H, T):
    """The calls whose merge is launched early by default (`pdl_pays`: its programs wait in griddepcontrol.wait while
    the attention runs) replay correctly in a CUDA graph (make_case: -1 padding, duplicates, slots past the cache and,
    at 2 tokens, one token with no valid slot)."""
    from glm5lab.kernels.sparse_mla import choose_num_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = sparse_mla_sm90.default_config(H, True, T, sms)
    programs = T * choose_num_splits(T, 1, 2048, cfg["block_n"], sms, cfg.get("resident", 2))
    assert sparse_mla_sm90.pdl_pays(cfg, True, programs, sms)
    q, cache, slots, _ = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    ref = sparse_mla_reference(q, dequantize_fp8_ds_mla(cache), torch.where(slots >= 65536, -1, slots), SCALE)
    _check_cuda_graph_replay(q, cache, slots, tuple(x.cpu() for x in ref), None)


def _check_cuda_graph_replay(q, cache, slots, ref, config):
    """Compile outside the capture, capture one call into NaN-poisoned outputs, replay, compare with ref."""
    T, H, _ = q.shape
    out = torch.full((T, H, 512), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((T, H), float("nan"), device="cuda")
    sparse_mla_attention(q, cache, slots, SCALE, out=out, lse=lse, _config=config)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_attention(q, cache, slots, SCALE, out=out, lse=lse, _config=config)
    graph.replay()
    torch.cuda.synchronize()
    check(out, lse, ref, q.dtype)


def test_unknown_impl_is_a_clear_error(device):
    q, cache, slots, _ = make_case(1, 8, 40, 100, torch.bfloat16, "fp8_ds_mla", device)
    with pytest.raises(Glm5labError, match="unknown kernel impl 'cuda'"):
        sparse_mla_attention(q, cache, slots, SCALE, _config={"impl": "cuda"})


def test_cpu_and_interpreter_never_pick_the_gluon_kernel_by_itself(device):
    """Where the Gluon kernel cannot run (here: no GPU, or the interpreter) the default is the Triton kernel, so an
    fp8 call with 8 heads and bf16 q just works."""
    from glm5lab.kernels.sparse_mla import _gluon_by_default

    q, cache, slots, ref = make_case(2, 8, 40, 100, torch.bfloat16, "fp8_ds_mla", device)
    if device == "cpu":
        assert not _gluon_by_default(q, True, 8, "auto", None)
    out, lse = run_poisoned(q, cache, slots)
    check(out, lse, ref, torch.bfloat16)


# ------------------------------------------------------------- the bf16/fp16-cache kernel (NOTES.md v7, run 8)

MMA_SYNC_16BIT = dict(sparse_mla_sm90.DEFAULT_CONFIG)   # the 32-row mma.sync tile (two CTAs a SM), forced
CFGS_16BIT = pytest.mark.parametrize("cfg", [GLUON, MMA_SYNC_16BIT], ids=["default", "mma_sync"])


@pytest.mark.gpu
@CFGS_16BIT
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [5, 8, 16])
@pytest.mark.parametrize("T", [1, 8, 130])
def test_gpu_gluon_16bit_real_shapes(cfg, dtype, H, T):
    """Default (the rows-as-M kernel at 1 and 8 tokens, the 64-row mma.sync tile at 130: one wave on 132 SMs) and
    the 32-row mma.sync tile forced."""
    from glm5lab.kernels.sparse_mla import _gluon_by_default

    q, cache, slots, ref = make_case(T, H, 2048, 65536, dtype, "native", "cuda", block_size=64)
    assert _gluon_by_default(q, False, H, "auto", None)          # the default for these calls
    out, lse = run_poisoned(q, cache, slots, _config=cfg)
    check(out, lse, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("topk,splits", [(512, 1), (1000, 3), (77, 5), (2048, 64)])
@pytest.mark.parametrize("cfg", [GLUON, MMA_SYNC_16BIT, sparse_mla_sm90.ONE_WAVE_CONFIG],
                         ids=["default", "mma_sync", "one_wave"])
def test_gpu_gluon_16bit_odd_topk_splits_and_skipped_rows(cfg, topk, splits):
    """Odd top-k and forced splits; slot 0 (what -1 and out-of-range slots would fall back to) holds NaN."""
    q, cache, slots, _ = make_case(6, 8, topk, 65536, torch.bfloat16, "native", "cuda", block_size=64)
    slots[slots == 0] = 1
    ref = sparse_mla_reference(q, cache, torch.where(slots >= 65536, -1, slots), SCALE)
    cache.view(-1, 576)[0] = float("nan")
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config=cfg)
    check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16)


def test_early_merge_by_default_only_for_fp8_grids_that_leave_half_the_sms_idle():
    """`pdl_pays` (NOTES.md v25): the merge launches early by default for fp8_ds_mla calls of the kernels that signal it
    (mma.sync, one-consumer rows-as-M) with at most half the SMs' worth of programs -- 8 heads x 1 token (64 programs
    on 132 SMs) and 16 heads x 1-2 tokens (32 / 64), not 8 heads x 2 tokens (128) nor 16 heads x 4; never for bf16
    caches, the dual-consumer / persistent kernels or the 64-head ones."""
    from glm5lab.kernels.sparse_mla import choose_num_splits, resident_ctas

    def programs(H, T, cfg):
        resident = cfg.get("resident", resident_ctas(cfg["block_h"]))
        return T * choose_num_splits(T, 1, 2048, cfg["block_n"], 132, resident)

    def default_pays(H, T, fp8=True):
        cfg = sparse_mla_sm90.default_config(H, fp8, T, 132)
        return sparse_mla_sm90.pdl_pays(cfg, fp8, programs(H, T, cfg), 132)

    assert programs(8, 1, sparse_mla_sm90.default_config(8, True, 1, 132)) == 64
    assert default_pays(8, 1) and default_pays(16, 1) and default_pays(16, 2)
    assert not default_pays(8, 2) and not default_pays(8, 4) and not default_pays(16, 4)
    assert not default_pays(8, 1, fp8=False) and not default_pays(16, 2, fp8=False)
    for cfg in (sparse_mla_sm90.ROWS_FP8_DUAL_CONFIG, sparse_mla_sm90.ROWS_FP8_PERSISTENT_CONFIG,
                sparse_mla_sm90.WGMMA_WS_CONFIG, sparse_mla_sm90.WGMMA_CONFIG):
        assert not sparse_mla_sm90.pdl_pays(cfg, True, 8, 132)
    assert sparse_mla_sm90.pdl_pays(sparse_mla_sm90.DEFAULT_CONFIG, True, 66, 132)
    assert not sparse_mla_sm90.pdl_pays(sparse_mla_sm90.DEFAULT_CONFIG, True, 67, 132)


def test_kernel_choice_by_capability_heads_layout_and_call():
    """Which kernel runs where, without a GPU: Gluon only on sm_90 (fp8 with bf16 q, bf16/fp16 caches; the 64-head
    wgmma kernel beyond 16 heads) and only when the call does not ask for a Triton-only feature; Triton everywhere
    else (SM80/89/100/120, the interpreter)."""
    from glm5lab.kernels.sparse_mla import kernel_for

    bf16, fp16 = torch.bfloat16, torch.float16
    assert kernel_for(8, "fp8_ds_mla", bf16, (9, 0)) == "gluon"
    assert kernel_for(16, "bf16", bf16, (9, 0)) == "gluon" and kernel_for(5, "fp16", fp16, (9, 0)) == "gluon"
    assert kernel_for(17, "bf16", bf16, (9, 0)) == "gluon" and kernel_for(64, "fp8_ds_mla", bf16, (9, 0)) == "gluon"
    assert kernel_for(128, "fp16", fp16, (9, 0)) == "gluon"
    assert kernel_for(8, "fp8_ds_mla", fp16, (9, 0)) == "triton" and kernel_for(64, "fp8_ds_mla", fp16, (9, 0)) == "triton"
    for cap in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0), None):
        assert kernel_for(8, "fp8_ds_mla", bf16, cap) == "triton"
    assert kernel_for(8, "bf16", bf16, (9, 0), merge="fused") == "triton"
    assert kernel_for(8, "bf16", bf16, (9, 0), config={"block_n": 32}) == "triton"
    with pytest.raises(Glm5labError, match="unknown KV layout 'fp4'"):
        kernel_for(8, "fp4", bf16, (9, 0))


@pytest.mark.parametrize("call, match", [
    (dict(capability=9), r"capability must be a \(major, minor\) tuple.*got 9"),
    (dict(capability=(9, "0")), r"capability must be a \(major, minor\) tuple"),
    (dict(num_heads=0), "head count must be 1..128, got 0"),
    (dict(num_heads=129), "head count must be 1..128, got 129"),
    (dict(num_heads=8.0), "head count must be 1..128, got 8.0"),
    (dict(q_dtype=torch.float32), "q must be float16 or bfloat16, got torch.float32"),
    (dict(layout="fp16"), r"q \(torch.bfloat16\) and a fp16 KV cache must have the same dtype"),
    (dict(merge="both"), "merge must be 'auto', 'fused' or 'separate', got 'both'"),
])
def test_kernel_choice_refuses_what_the_attention_call_refuses(call, match):
    """kernel_for names a kernel only for a call sparse_mla_attention would run, in the same words it refuses."""
    from glm5lab.kernels.sparse_mla import kernel_for

    args = dict(num_heads=8, layout="bf16", q_dtype=torch.bfloat16, capability=(9, 0), merge="auto") | call
    with pytest.raises(Glm5labError, match=match):
        kernel_for(**args)


def test_gluon_unavailable_names_the_reason():
    """The one rule behind kernel_for and the refusal of _config={"impl": "gluon"}: each reason in words."""
    from glm5lab.kernels.sparse_mla import gluon_unavailable

    assert gluon_unavailable(16, True, torch.bfloat16, (9, 0)) is None
    assert gluon_unavailable(8, False, torch.float16, (9, 0)) is None
    assert gluon_unavailable(64, True, torch.bfloat16, (9, 0)) is None
    assert gluon_unavailable(128, False, torch.float16, (9, 0)) is None
    assert "<= 128 heads, got 129" in gluon_unavailable(129, False, torch.bfloat16, (9, 0))
    assert "takes bf16 q" in gluon_unavailable(8, True, torch.float16, (9, 0))
    assert "no interpreter runs Gluon" in gluon_unavailable(8, True, torch.bfloat16, None)
    assert "sm_90 (Hopper) only" in gluon_unavailable(8, True, torch.bfloat16, (12, 0))
    cache = torch.zeros(4 * 64 * 656 + 16, dtype=torch.uint8)
    base = (16 - cache.data_ptr() % 16) % 16            # a 16-byte aligned view, and one 4 bytes off it
    aligned, off = (cache[b:b + 4 * 64 * 656].view(4, 64, 656) for b in (base, (base + 4) % 16))
    assert gluon_unavailable(8, True, torch.bfloat16, (9, 0), aligned) is None
    assert "address % 16 = 4 and rows 656 bytes apart" in gluon_unavailable(8, True, torch.bfloat16, (9, 0), off)
    rows = torch.zeros(64, 580, dtype=torch.bfloat16)[:, :576]       # rows 1160 bytes apart
    assert "rows 1160 bytes apart" in gluon_unavailable(8, False, torch.bfloat16, (9, 0), rows)


def test_kernel_bench_gluon_variants_by_name():
    """GLM5LAB_BENCH_GLUON picks the benchmark's Gluon tiles by name (all when empty); a wrong name is a clear
    error, not a silently shorter run."""
    from glm5lab.bench import kernel_bench

    everything = kernel_bench.gluon_variants("")
    assert [n for n, _ in everything] == [n for n, c in kernel_bench.GLUON_VARIANTS if not c.get("_diagnostic")]
    assert "ws8" in dict(everything) and not any(n.startswith("ws8d") for n, _ in everything)
    assert kernel_bench.gluon_variants("ws8d2")[0][1]["ws_diag"] == 2          # diagnostics only by name
    assert [n for n, _ in kernel_bench.gluon_variants("n64w8, s3")] == ["n64w8", "s3"]
    with pytest.raises(Glm5labError, match=r"unknown Gluon variant\(s\) \['s9'\]"):
        kernel_bench.gluon_variants("s2,s9")


# ------------------------------------------------------------- the 64-head wgmma kernel (NOTES.md v8), 17-128 heads

WGMMA = dict(sparse_mla_sm90.WGMMA_CONFIG)       # the one-CTA 64-head tile (NOTES.md v8), forced
WGMMA_WS = dict(sparse_mla_sm90.WGMMA_WS_CONFIG)  # the same step warp-specialized, the default beyond 16 heads (v12)
WGMMA_CV = dict(sparse_mla_sm90.WGMMA_CV_CONFIG)  # its fp8_ds_mla form, dequantized by a producer warpgroup (v15)
# both with P.V's A operand through shared memory (p_smem, the default since v16) and without it (the S exchange of
# v12-v15)
WGMMA_WSP, WGMMA_CVP = {**WGMMA_WS, "p_smem": True}, {**WGMMA_CV, "p_smem": True, "f16_tile": False}
WGMMA_WS, WGMMA_CV = {**WGMMA_WS, "p_smem": False}, {**WGMMA_CV, "p_smem": False, "f16_tile": False}
# ... and the converter form with the dequantized tile and q's latent part in fp16 (f16_tile, NOTES.md v28-v29)
WGMMA_CV16 = {**WGMMA_CVP, "f16_tile": True, "kept_p": False}
# ... and with P against the kept max (kept_p, NOTES.md v31; the fp16 tile's default since v32): that form and the
# loader / 16-bit one
WGMMA_CV16K, WGMMA_WSPK = {**WGMMA_CV16, "kept_p": True}, {**WGMMA_WSP, "kept_p": True}
BOTH_WGMMA = pytest.mark.parametrize("wcfg", [WGMMA, WGMMA_WS], ids=["wg64", "ws64"])
FP8_WGMMA = pytest.mark.parametrize("wcfg", [WGMMA, WGMMA_WS, WGMMA_CV, WGMMA_CVP, WGMMA_CV16, WGMMA_WSP, WGMMA_CV16K,
                                             WGMMA_WSPK],
                                    ids=["wg64", "ws64", "cv64", "cv64p", "cv64f16", "ws64p", "cv64f16k", "ws64pk"])


def _bf16_dequantized_ref(q, cache, slots):
    """What the wgmma kernel computes for fp8_ds_mla: attention over the dequantized cache rounded to bf16 (e4m3 x
    scale in fp32, then one rounding, as FlashMLA does), so the usual tolerances apply against THAT reference.
    (Against the exact dequantized cache the extra rounding moves lse by ~1e-3: H200, NOTES.md v8.)"""
    kv = dequantize_fp8_ds_mla(cache).to(torch.bfloat16)
    return tuple(x.cpu() for x in sparse_mla_reference(q, kv, torch.where(slots >= kv.view(-1, 576).shape[0], -1,
                                                                                 slots), SCALE))


def _f16_dequantized_ref(q, cache, slots):
    """What the fp16 tile (f16_tile, NOTES.md v28) computes, written independently of the kernel: within each
    64-row step of a token's slot list (splits start at multiples of 64 rows, so steps never straddle them), the
    scales divided by 2^e (e: 0 while the step's largest scale lies in [2^-12, 2^7), else its exponent clamped to
    [-40, 40]; skipped slots count as zero scales), each latent value e4m3 x (that scale rounded to fp16) rounded
    once to fp16 (the product of an e4m3 value and an fp16 is exact in fp32), times 2^e again (exact in float64);
    the rope values as stored. Rows dequantize per (token, step), so each token gets a cache of its own."""
    flat = cache.view(-1, 656).cpu()
    n = flat.shape[0]
    e4m3 = flat[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(-1, 4, 128)
    scale = flat[:, 512:528].contiguous().view(torch.float32)
    rope = flat[:, 528:].contiguous().view(torch.bfloat16).double()
    sl = slots.cpu().long()
    T, K = sl.shape
    valid = (sl >= 0) & (sl < n)
    idx = torch.where(valid, sl, 0)
    steps = -(-K // 64)
    step_scales = torch.zeros(T, steps * 64, 4)
    step_scales[:, :K] = torch.where(valid[..., None], scale[idx].abs(), 0.0)
    m = step_scales.view(T, steps, 256).amax(dim=2)                               # [T, steps]
    exp = torch.frexp(m)[1] - 1
    e = torch.where((m > 0) & ((exp < -12) | (exp >= 7)), exp.clamp(-40, 40), 0)
    e = e.repeat_interleave(64, dim=1)[:, :K].double()                             # [T, K]
    unscaled = torch.ldexp(scale[idx].double(), -e[..., None]).float().half().double()
    lat = torch.ldexp((e4m3[idx] * unscaled[..., None]).half().double(), e[..., None, None]).view(T, K, 512)
    kv = torch.cat([lat, rope[idx]], dim=2)
    own = torch.where(valid, torch.arange(T)[:, None] * K + torch.arange(K)[None, :], -1).to(torch.int32)
    return tuple(x.cpu() for x in sparse_mla_reference(q, kv.view(T * K, 576).to(q.device), own.to(q.device), SCALE))


def _tile_ref(wcfg):
    """The reference a 64-head fp8_ds_mla tile is checked against: its dequantized tile's rounding."""
    return _f16_dequantized_ref if wcfg.get("f16_tile") else _bf16_dequantized_ref


@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_gluon_wgmma_sm90_build_feeds_the_tensor_cores_from_shared_memory(fp8):
    """The 64-head kernel's sm90 build: wgmma (HGMMA: 36 for q.K^T over 576 values, 4 for P.V a 64-row step) and
    no mma.sync or ldmatrix, cp.async gathers in the loop, no spill, and the ring fits one CTA a SM (<= 227 KB)."""
    rep = _sm90_build(BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8)
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["HGMMA"] == 40 and rep.get("HMMA", 0) == 0 and rep.get("LDSM", 0) == 0
    assert rep["LDGSTS"] > 0 and rep["smem"] <= 227 * 1024
    if fp8:
        assert rep["F2FP"] > 0      # e4m3 pairs dequantized in the loop


@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_gluon_wgmma_ws_sm90_build_is_warp_specialized(fp8):
    """The warp-specialized 64-head kernel's sm90 build: the consumers' 40 wgmma a step and the loader's cp.async
    in one CTA (<= 227 KB), the registers moved to the consumers (loader 56, consumers 224), no spill for bf16/fp16
    and at most one 8-byte slot for fp8_ds_mla (the dequantization beside an O tile of 128 registers a thread)."""
    rep = _sm90_build(ws=True, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8)
    assert rep["HGMMA"] == 40 and rep["LDGSTS"] > 0 and rep["smem"] <= 227 * 1024 and rep["regs"] <= 168
    assert {56, 224} <= set(rep["setmaxnreg"])
    assert rep["stack"] <= (8 if fp8 else 0)
    if fp8:
        assert rep["F2FP"] > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8"])
def test_gluon_wgmma_ws_sm90_build_writes_fp16_partials(fp8):
    """PART_F16 (_config={"partials": "fp16"}): the warp-specialized 64-head build converts the O tile's 128 values a
    consumer thread to 64 fp16 pairs at the store (64 F2FP more than the fp32-partial build) and, in stored-column
    order, writes them with 32 8-byte stores (the fp32 partial: 64; in true order fp16 would take 64 4-byte ones), with
    the same wgmma and shared memory and no more spill slots (the fp8 loader form's one 8-byte slot, outside the step
    loop, comes and goes with the register allocation); the default build does not change (the constexpr defaults
    to False)."""
    plain = _sm90_build(ws=True, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8, _sass=True)
    half = _sm90_build(ws=True, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8, PART_F16=True, _sass=True)
    assert half["F2FP"] == plain["F2FP"] + 64
    wide = [sum(i.startswith("STG.E.64 ") for i in rep["_sass"]) for rep in (plain, half)]
    assert wide == [64, 32]
    assert half["HGMMA"] == plain["HGMMA"] == 40 and half["smem"] == plain["smem"]
    assert half["stack"] <= plain["stack"] <= 8 and half["regs"] <= 168


@pytest.mark.parametrize("fp8,converter", [(False, False), (True, False), (True, True)],
                         ids=["16bit", "fp8-loader", "fp8-converter"])
def test_gluon_wgmma_ws_p_smem_build_exchanges_no_scores(fp8, converter):
    """p_smem (NOTES.md v16, the default): the consumers' step keeps S where wgmma left it -- no layout conversion of
    the scores (the exchange build's runs 4 rounds of STS.128 / BAR / LDS.128 through a 4 KB buffer) --, P is
    stored once with stmatrix (STSM) and read by P.V's wgmma from shared memory; fewer CTA barriers, the same 40 wgmma,
    no spill, one CTA a SM (<= 227 KB with the 8 KB P tile). And O's rescale is lazy (v30): one warp vote a step,
    whose branch skips O's 128 multiplies a thread before P.V."""
    plain = _sm90_build(ws=True, converter=converter, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8, _sass=True)
    ps = _sm90_build(ws=True, converter=converter, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8, P_SMEM=True,
                     _sass=True)
    assert ps["HGMMA"] == plain["HGMMA"] == 40 and ps["smem"] <= 227 * 1024 and ps["stack"] <= plain["stack"]
    assert sum(i.startswith("STSM") for i in ps["_sass"]) > 0 == sum(i.startswith("STSM") for i in plain["_sass"])
    assert ps["BAR"] < plain["BAR"]
    pv = [i for i in ps["_sass"] if i.startswith("HGMMA.64x256x16")]     # P.V: both operands descriptors
    assert pv and all(re.match(r"HGMMA\S+ R\d+, gdesc\[\w+\]", i) for i in pv)
    assert _skipped_o_multiplies(ps["_sass"]) == 128
    assert not any(i.startswith("VOTE.ANY") for i in plain["_sass"])


def _skipped_o_multiplies(sass: list) -> int:
    """The lazy rescale of O in a 64-head P-through-shared-memory build (NOTES.md v30): the build's one warp vote,
    the first branch after it (ptxas may schedule the step's other work between them), and the multiplies between
    that branch and P.V's first wgmma (the block the branch skips)."""
    votes = [k for k, i in enumerate(sass) if i.startswith("VOTE.ANY")]
    assert len(votes) == 1, f"{len(votes)} warp votes"
    branch = next(k for k in range(votes[0] + 1, votes[0] + 64) if sass[k].startswith("BRA"))
    skipped = sass[branch + 1:]
    return sum(i.startswith("FMUL") for i in skipped[:next(k for k, i in enumerate(skipped)
                                                            if i.startswith("HGMMA.64x256x16"))])


def _barriers_from_s_to_pv(sass_at: list) -> int:
    """CTA barriers a 64-head consumer step crosses from q.K^T's last wgmma to P.V's first on its common path: every
    forward conditional branch in between taken (the kept-max build's uniform branch around its rare path, the lazy
    rescale's around O's multiplies, lane branches around single stores)."""
    pv = next(k for k, (_, t) in enumerate(sass_at) if "HGMMA.64x256x16" in t)
    k = max(j for j in range(pv) if "HGMMA.64x32x16" in sass_at[j][1])
    at = {a: j for j, (a, _) in enumerate(sass_at)}
    bars = 0
    while k < pv:
        a, t = sass_at[k]
        bars += "BAR.SYNC" in t
        branch = re.match(r"@!?P\d\s+BRA\s+0x([0-9a-f]+)", t)
        if branch and a < int(branch.group(1), 16) and at.get(int(branch.group(1), 16), pv + 1) <= pv:
            k = at[int(branch.group(1), 16)]
        else:
            k += 1
    return bars


@pytest.mark.parametrize("form", ["converter-fp16-tile", "16bit"])
def test_gluon_kept_max_build_crosses_one_barrier_from_s_to_pv(form):
    """P against the kept max (kept_p, NOTES.md v31): the consumers' common path from S's last wgmma to P.V's first
    crosses ONE CTA barrier (P's, which carries the warps' flags), where the build without it crosses P's and the
    row max's reduction across the warpgroups (2-3 more); the rare path's barriers lie behind a uniform branch. No
    spill (q's wgmma descriptors are rebuilt each step: kept across the loop, ptxas spilled them, 296 bytes)."""
    extra = {"converter": True, "F16_TILE": True, "FP8": True} if form == "converter-fp16-tile" else {"FP8": False}
    base = dict(ws=True, BLOCK_H=64, BLOCK_N=64, num_warps=8, P_SMEM=True, PART_F16=True, **extra)
    kept, plain = _sm90_build(_sass=True, KEPT_P=True, **base), _sm90_build(_sass=True, **base)
    assert kept["stack"] == 0 and kept["HGMMA"] == 40 and kept["smem"] <= 227 * 1024
    assert _barriers_from_s_to_pv(kept["_sass_at"]) == 1
    assert _barriers_from_s_to_pv(plain["_sass_at"]) >= 3


def test_gluon_rows_sm90_build_is_wgmma_only_without_spilling():
    """The rows-as-M kernel (<= 16 heads, bf16/fp16): 36 wgmma for S^T = K.q^T over 576 values and 32 for O^T =
    V^T.P^T (8 tiles of 64 latent dims x 4), no mma.sync or ldmatrix, cp.async in the loop, no spill, one CTA a SM."""
    rep = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=False, num_warps=4)
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["HGMMA"] == 68 and rep.get("HMMA", 0) == 0 and rep.get("LDSM", 0) == 0
    assert rep["LDGSTS"] > 0 and rep["smem"] <= 227 * 1024


def test_gluon_wgmma_refuses_32_row_fp8_steps_at_build():
    (line,) = offline_build.sass_report({"gluon": True, "BLOCK_H": 64, "BLOCK_N": 32, "STAGES": 2, "SPLIT": True,
                                         "FP8": True, "num_warps": 8}, ok=False)
    assert "64 rows" in line["error"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,wcfg", [
    *((layout, dtype, wcfg) for layout, dtype in (("native", torch.bfloat16), ("native", torch.float16))
      for wcfg in (WGMMA, WGMMA_WS, WGMMA_WSP, WGMMA_WSPK)),
    *(("fp8_ds_mla", torch.bfloat16, wcfg) for wcfg in (WGMMA, WGMMA_WS, WGMMA_WSP, WGMMA_CV, WGMMA_CVP, WGMMA_CV16,
                                                         WGMMA_CV16K, WGMMA_WSPK))],
    ids=["bf16-wg64", "bf16-ws64", "bf16-ws64p", "bf16-ws64pk", "fp16-wg64", "fp16-ws64", "fp16-ws64p",
         "fp16-ws64pk", "fp8-wg64", "fp8-ws64", "fp8-ws64p", "fp8-cv64", "fp8-cv64p", "fp8-cv64f16", "fp8-cv64f16k",
         "fp8-ws64pk"])
@pytest.mark.parametrize("H", [17, 64, 128])
@pytest.mark.parametrize("T", [1, 8, 130])
def test_gpu_gluon_wgmma_real_shapes(layout, dtype, wcfg, H, T):
    """Top-k 2048 over 65,536 slots, default splits; 17 heads fills a 64-head tile partly, 128 heads takes two;
    both 64-head kernels."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, dtype, layout, "cuda", block_size=64)
    if layout == "fp8_ds_mla":
        ref = _tile_ref(wcfg)(q, cache, slots)
    out, lse = run_poisoned(q, cache, slots, _config=wcfg)
    check(out, lse, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["wg64", "wg64n32", "ws64", "ws64p", "ws64pk"])
@pytest.mark.parametrize("topk,splits", [(512, 1), (1000, 3), (77, 5), (2048, 32)])
def test_gpu_gluon_wgmma_odd_topk_splits_and_skipped_rows(tile, topk, splits):
    """bf16 cache: odd top-k, forced splits, both step sizes, both 64-head kernels; slot 0 (the fallback of -1 /
    out-of-range slots) holds NaN, so a read of a skipped row would poison the output."""
    q, cache, slots, _ = make_case(6, 64, topk, 65536, torch.bfloat16, "native", "cuda", block_size=64)
    slots[slots == 0] = 1
    ref = sparse_mla_reference(q, cache, torch.where(slots >= 65536, -1, slots), SCALE)
    cache.view(-1, 576)[0] = float("nan")
    cfg = {"wg64": WGMMA, "wg64n32": {**WGMMA, "block_n": 32}, "ws64": WGMMA_WS, "ws64p": WGMMA_WSP,
           "ws64pk": WGMMA_WSPK}[tile]
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config=cfg)
    check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("topk,splits", [(1000, 3), (77, 5)])
@FP8_WGMMA
def test_gpu_gluon_wgmma_fp8_skipped_rows_and_byte_patterns(topk, splits, wcfg):
    """fp8_ds_mla: every e4m3 byte pattern, and NaN bytes and scales in slot 0 that no valid slot points at."""
    q, cache, slots, _ = _raw_fp8_case("cuda", T=5, H=64, topk=512, num_slots=4096)
    ref = _tile_ref(wcfg)(q, cache, slots)
    out, lse = run_poisoned(q, cache, slots, _config=wcfg)
    check(out, lse, ref, torch.bfloat16)
    q, cache, slots, _ = make_case(4, 64, topk, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    slots[slots == 0] = 1
    ref = _tile_ref(wcfg)(q, cache, slots)
    flat = cache.view(-1, 656)
    flat[0, :512] = 0x7F
    flat[0, 512:528] = torch.tensor([float("nan")] * 4, device="cuda").view(torch.uint8)
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config=wcfg)
    check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16)


@pytest.mark.gpu
@FP8_WGMMA
@pytest.mark.parametrize("q_mag,scale_range", [(3e4, (1e-8, 1e-6)), (1e-6, (1e2, 1e4)), (3e4, (1e-12, 1e-6))],
                         ids=["q-beyond-fp16-tiny-scales", "q-below-fp16-normals-large-scales",
                              "scales-spanning-6-decades"])
def test_gpu_gluon_wgmma_fp8_q_and_scale_ranges(wcfg, q_mag, scale_range):
    """The 64-head tiles on q beyond / below fp16's range and chunk scales far outside it (values up to 448e4 and
    down to 1e-12 x 2^-9; a row's chunk scales up to 1e6 apart): with the fp16 tile's power of two a step and q's a
    head no value overflows, and the digits lost to fp16's subnormals are the reference's too (each tile's
    rounding). (Steps of one split whose powers of two differ by ~10 or more: the test below.)"""
    q, cache, slots = (x.cuda() for x in _range_case(q_mag, scale_range, H=64))
    out, lse = run_poisoned(q, cache, slots, _config=wcfg)
    check(out, lse, _tile_ref(wcfg)(q, cache, slots), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("outlier_scale", [2.0**10, 2.0**20, 2.0**30])
@pytest.mark.parametrize("wcfg", [WGMMA_CV16, WGMMA_CV16K], ids=["cv64f16", "cv64f16k"])
def test_gpu_gluon_fp16_tile_keeps_other_steps_of_an_outlier_split(outlier_scale, wcfg):
    """NOTES.md v28's cross-step limit, gone since O is kept relative to the step's power of two (v29): one row of
    zero latent values and a huge scale among scales of 0.01 -- its step's power of two is 2^10-2^30 above the
    others' -- leaves the other steps of the split as the tile's reference has them (v28's form, P relative to 2^e,
    lost them to fp16's subnormals: a CPU emulation put it at 63% error at 2^30). One split a token, so that the
    outlier's step is one of 32 in its program (the default's 32 splits of one step each had no other steps)."""
    g = torch.Generator().manual_seed(fresh_seed())
    num_slots, T, H, topk = 4096, 2, 64, 2048
    cache = torch.randint(0, 256, (num_slots, 656), generator=g, dtype=torch.uint8)
    cache[:, :512][(cache[:, :512] & 0x7F) == 0x7F] = 0x3C
    scales = torch.full((num_slots, 4), 0.01)
    scales[0] = outlier_scale
    cache[:, 512:528] = scales.view(torch.uint8)
    cache[0, :512] = 0                                                       # its latent values are zero
    cache[:, 528:] = (torch.randn(num_slots, 64, generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    slots = torch.randint(1, num_slots, (T, topk), generator=g, dtype=torch.int32)
    slots[:, 100] = 0                                                        # the outlier in each token's 2nd step
    q, cache, slots = q.cuda(), cache.cuda(), slots.cuda()
    out, lse = run_poisoned(q, cache, slots, num_splits=1, _config=wcfg)
    check(out, lse, _f16_dequantized_ref(q, cache, slots), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,wcfg", [("native", WGMMA_WSP), ("fp8_ds_mla", WGMMA_WSP), ("fp8_ds_mla", WGMMA_CVP),
                                         ("fp8_ds_mla", WGMMA_CV16), ("native", WGMMA_WS), ("native", WGMMA_WSPK),
                                         ("fp8_ds_mla", WGMMA_WSPK), ("fp8_ds_mla", WGMMA_CV16K)],
                         ids=["bf16-ws64p", "fp8-ws64p", "fp8-cv64p", "fp8-cv64f16", "bf16-ws64", "bf16-ws64pk",
                              "fp8-ws64pk", "fp8-cv64f16k"])
@pytest.mark.parametrize("spread", [1.0, 16.0], ids=["kept-moves", "large-moves"])
def test_gpu_gluon_wgmma_rows_sorted_by_score(layout, wcfg, spread):
    """One split a token (32 steps a program), heads 0-31 sharing one q and each token's rows in order of their
    score, rising (those heads' running max moves at every step -- with q as drawn mostly by less than the lazy
    rescale's threshold of 8 in log2 units, so kept, p up to 2^8; with q 16 times larger often by more, so that P
    against the kept max (`kept_p`, NOTES.md v31) must be redone; both asserted below, and lse's tolerance then
    grows with its size, ~200) and
    falling (only at the first step); heads 32-63 in no order: the 64-head P-through-shared-memory forms, which
    rescale O lazily (NOTES.md v30), match the reference, as the exchange-of-S form does, which rescales at every
    step."""
    q, cache, slots, _ = make_case(4, 64, 2048, 65536, torch.bfloat16, layout, "cuda", block_size=64)
    q[:, :32] = q[:, :1] * spread
    kv = (dequantize_fp8_ds_mla(cache) if layout == "fp8_ds_mla" else cache).view(-1, 576).float()
    valid = (slots >= 0) & (slots < kv.shape[0])
    score = torch.einsum("td,tkd->tk", q[:, 0].float(), kv[slots.clamp(0, kv.shape[0] - 1).long()])
    score = torch.where(valid, score * SCALE * 1.4426950408889634, float("-inf"))      # log2 units, as the kernel
    rising = torch.gather(slots, 1, score.argsort(dim=1))
    step_max = torch.sort(score, dim=1).values.view(4, 32, 64).amax(dim=2)
    moves = step_max[:, 1:] - step_max[:, :-1]
    moves = moves[torch.isfinite(moves)]                # (steps of skipped slots only, -inf, rise by +inf)
    if spread == 1.0:
        assert bool(((moves > 0) & (moves <= 8)).any()), "no step keeps a moved max: the lazy path goes untested"
    else:
        assert int((moves > 8).sum()) >= 8, "too few steps move the max beyond the threshold"
    for ordered in (rising, rising.flip(1).contiguous()):
        if layout == "fp8_ds_mla":
            ref = _tile_ref(wcfg)(q, cache, ordered)
        else:
            ref = tuple(x.cpu() for x in sparse_mla_reference(q, cache, torch.where(ordered >= 65536, -1, ordered),
                                                               SCALE))
        out, lse = run_poisoned(q, cache, ordered, num_splits=1, _config=wcfg)
        check(out, lse, ref, torch.bfloat16, lse_rel=0.0 if spread == 1.0 else 1e-6)


@pytest.mark.gpu
@FP8_WGMMA
def test_gpu_gluon_wgmma_all_invalid_tokens_and_cuda_graph(wcfg):
    q, cache, slots, _ = make_case(5, 128, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    slots[0] = -1
    _check_cuda_graph_replay(q, cache, slots, _tile_ref(wcfg)(q, cache, slots), wcfg)


def test_gluon_tiles_by_head_count():
    """16-head mma.sync tiles up to 16 heads, the warp-specialized 64-head wgmma tile (one CTA a SM) beyond; the
    benchmark's variants follow the same split, and the wgmma kernels' fp8 form is timed with 64-row steps only."""
    from glm5lab.bench.kernel_bench import gluon_variant_runs
    from glm5lab.kernels import sparse_mla_sm90 as sm90
    from glm5lab.kernels.sparse_mla import choose_num_splits, resident_ctas

    for H in (1, 8, 16):
        assert sm90.default_config(H)["block_h"] == 16 and not sm90.default_config(H).get("rows")
        assert sm90.default_config(H, False, 1)["rows"] and sm90.default_config(H, False, 16)["rows"]
        assert not sm90.default_config(H, False, 17).get("rows")                # larger batches: mma.sync,
        assert sm90.default_config(H, False, 17)["block_n"] == 64               # 64-row steps up to one wave
        assert sm90.default_config(H, False, 132) == sm90.ONE_WAVE_CONFIG
        assert sm90.default_config(H, False, 133) == sm90.DEFAULT_CONFIG        # 32-row steps beyond
        assert sm90.default_config(H, False, 100, num_sms=78) == sm90.DEFAULT_CONFIG
        # the dual-consumer 16-head tile (NOTES.md v17; "sop", v34-v39, the shorter step since v40) from 24 tokens at
        # 9-16 heads and from 16 at <= 8 heads (v36), ...
        dual_from = sm90.FP8_DUAL_MIN_TOKENS_AT_8_HEADS if H <= 8 else sm90.FP8_DUAL_MIN_TOKENS
        assert (dual_from, sm90.FP8_DUAL_MIN_TOKENS) == ((16, 24) if H <= 8 else (24, 24))
        assert sm90.default_config(H, True, 4) == sm90.default_config(H, True, dual_from - 1) == sm90.ROWS_FP8_CONFIG
        # ... at <= 8 heads on the dual kernel's own 8-head tile, one item a program (v36; v18-v35 the persistent one)
        dual = WS8X2ESOPK if H <= 8 else WS8X2SOKPH
        assert dual["pipe"] == ("sop" if H <= 8 else "soph") and dual["kept_p"]
        assert dual["block_h"] == (8 if H <= 8 else 16)
        assert sm90.default_config(H, True, dual_from) == sm90.default_config(H, True, 66) == dual
        assert sm90.default_config(H, True, 132) == sm90.default_config(H, True, 67) == dual
        assert sm90.default_config(H, True, 40, num_sms=78) == dual
        # ... and its paired form (one consumer, two CTAs a SM; v38) once the tokens outnumber the SMs, at 9-16 heads
        # with its loader's row offsets in 32 bits where the cache allows (v41)
        paired = sm90.ROWS_FP8_PAIRED_8_CONFIG if H <= 8 else sm90.ROWS_FP8_PAIRED_CONFIG
        assert paired == {**dual, "stages": 2, "resident": 2, "paired": True, "pipe": "sop" if H <= 8 else "sopfh",
                          "offs32": False if H <= 8 else "auto"}
        assert not dual["paired"]
        assert sm90.default_config(H, True, 133) == sm90.default_config(H, True, 512) == paired
        assert sm90.default_config(H, True, 79, num_sms=78) == paired
        # (on a GPU of few SMs the paired form starts where the dual one would)
        assert sm90.default_config(H, True, dual_from, num_sms=8) == paired
        assert sm90.default_config(H, True, dual_from - 1, num_sms=8) == sm90.ROWS_FP8_CONFIG
        assert sm90.kernel_of_config(paired, True) is sm90._sparse_mla_rows_fp8_paired_sm90_kernel
        assert sm90.default_config(H, True, 20, num_sms=78) == (dual if H <= 8 else sm90.ROWS_FP8_CONFIG)
        assert sm90.default_config(H, True, 1) == (sm90.ROWS_FP8_CONFIG if H > 8 else sm90.DEFAULT_CONFIG)
        assert sm90.default_config(H, True, 3) == (sm90.ROWS_FP8_CONFIG if H > 8 else sm90.DEFAULT_CONFIG)
        assert sm90.kernel_of(16, False, rows=True) is sm90._sparse_mla_rows_sm90_kernel
        assert sm90.kernel_of(16, True) is sm90._sparse_mla_fp8_sm90_kernel
        assert sm90.kernel_of(16, False) is sm90._sparse_mla_16bit_sm90_kernel
    for T in (16, 66, 67, 100, 512):      # (the dual tiles' top-k unsplit from 67 tokens: one CTA a SM, 132 // T < 2)
        assert (choose_num_splits(T, 1, 2048, 64, 132, resident=1) == 1) == (T >= 67), T
    for H in (17, 64, 128):
        for T in (None, 1, 8, 512):
            assert sm90.default_config(H, False, T) == sm90.default_config(H, True, T) == sm90.WGMMA_WS_CONFIG
        cfg = sm90.default_config(H)
        assert (cfg["block_h"], cfg["num_warps"]) == (64, 8) and resident_ctas(cfg["block_h"]) == 1
    assert sm90.kernel_of(64, True) is sm90.kernel_of(64, False) is sm90._sparse_mla_wgmma_sm90_kernel
    ws_kernel = sm90._sparse_mla_wgmma_ws_sm90_kernel
    assert sm90.kernel_of(64, True, ws=True) is sm90.kernel_of(64, False, ws=True) is ws_kernel
    assert gluon_variant_runs("ws64", 64, "fp8_ds_mla") and gluon_variant_runs("ws64", 128, "bf16")
    assert not gluon_variant_runs("ws64", 16, "fp8_ds_mla")
    sm90.default_config(64)["block_n"] = 1                      # a copy: the module default is not changed
    assert sm90.WGMMA_WS_CONFIG["block_n"] == 64
    assert gluon_variant_runs("s2", 8, "fp8_ds_mla") and not gluon_variant_runs("s2", 64, "bf16")
    assert gluon_variant_runs("wg64", 64, "fp8_ds_mla") and not gluon_variant_runs("wg64", 16, "bf16")
    assert gluon_variant_runs("wg64n32", 128, "bf16")
    assert not gluon_variant_runs("wg64n32", 128, "fp8_ds_mla")
    assert gluon_variant_runs("rows64", 8, "bf16") and not gluon_variant_runs("rows64", 8, "fp8_ds_mla")
    assert not gluon_variant_runs("rows64", 64, "bf16")
    assert gluon_variant_runs("n64", 16, "bf16") and not gluon_variant_runs("n64", 16, "fp8_ds_mla")
    assert gluon_variant_runs("ws8", 8, "fp8_ds_mla") and not gluon_variant_runs("ws8", 8, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [5, 8, 16])
@pytest.mark.parametrize("T", [1, 8, 130])
def test_gpu_gluon_rows_kernel_real_shapes(dtype, H, T):
    """The rows-as-M wgmma kernel (bf16/fp16 caches) forced at real shapes, default splits."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, dtype, "native", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots, _config=sparse_mla_sm90.ROWS_CONFIG)
    check(out, lse, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("topk,splits", [(1000, 3), (77, 5)])
def test_gpu_gluon_rows_kernel_odd_topk_and_skipped_rows(topk, splits):
    q, cache, slots, _ = make_case(6, 8, topk, 65536, torch.bfloat16, "native", "cuda", block_size=64)
    slots[slots == 0] = 1
    ref = sparse_mla_reference(q, cache, torch.where(slots >= 65536, -1, slots), SCALE)
    cache.view(-1, 576)[0] = float("nan")
    out, lse = run_poisoned(q, cache, slots, num_splits=splits,
                            _config=sparse_mla_sm90.ROWS_CONFIG)
    check(out, lse, tuple(x.cpu() for x in ref), torch.bfloat16)


def test_rows_kernels_refuse_other_tiles_before_launching():
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    for fp8, cfg in ((False, sm90.ROWS_CONFIG), (True, sm90.ROWS_FP8_CONFIG)):
        with pytest.raises(Glm5labError, match="16-head tiles, 64-row steps and 4 warps, got block_h 64"):
            sm90.launch((1, 1, 1), (), {**cfg, "block_h": 64}, False, fp8)
        with pytest.raises(Glm5labError, match="block_n 32"):
            sm90.launch((1, 1, 1), (), {**cfg, "block_n": 32}, False, fp8)
    with pytest.raises(Glm5labError, match="takes 2 stages"):
        sm90.launch((1, 1, 1), (), {**sm90.ROWS_FP8_CONFIG, "stages": 3}, False, True)
    with pytest.raises(Glm5labError, match="ws_diag 2 is a private timing diagnostic"):
        sm90.launch((1, 1, 1), (), {**sm90.ROWS_FP8_CONFIG, "ws_diag": 2}, False, True)
    with pytest.raises(Glm5labError, match="ws_diag 5 is a private timing diagnostic"):
        sm90.launch((1, 1, 1), (), {**sm90.ROWS_FP8_CONFIG, "ws_diag": 5, "_diagnostic": True}, False, True)
    with pytest.raises(Glm5labError, match="ws_diag 1 is a private timing diagnostic .* 1-4 of the fp8_ds_mla rows"):
        sm90.launch((1, 1, 1), (), {**sm90.ROWS_CONFIG, "ws_diag": 1, "_diagnostic": True}, False, False)
    ws = {**sm90.WGMMA_WS_CONFIG, "_diagnostic": True}
    for diag, fp8 in ((1, True), (4, True), (5, False), (9, True)):     # the 64-head kernel: 2-3, and 5 for fp8
        with pytest.raises(Glm5labError, match=f"ws_diag {diag} is a private timing diagnostic"):
            sm90.launch((1, 1, 1), (), {**ws, "ws_diag": diag}, False, fp8)
    with pytest.raises(Glm5labError, match="ws_diag 3 is a private timing diagnostic"):     # without _diagnostic
        sm90.launch((1, 1, 1), (), {**sm90.WGMMA_WS_CONFIG, "ws_diag": 3}, False, True)
    for diag, fp8 in ((2, False), (3, True), (5, True)):
        sm90.check_tile({**ws, "ws_diag": diag}, fp8)
    assert sm90.kernel_of(16, True, rows=True) is sm90._sparse_mla_rows_fp8_sm90_kernel
    for key, value in (("block_h", 16), ("block_n", 32), ("num_warps", 4), ("stages", 3)):
        with pytest.raises(Glm5labError, match=f"warp-specialized 64-head kernel takes .* got .*{key} {value}"):
            sm90.launch((1, 1, 1), (), {**sm90.WGMMA_WS_CONFIG, key: value}, False, True)


def test_gluon_rows_fp8_sm90_build_is_warp_specialized_without_spilling():
    """The fp8_ds_mla rows-as-M kernel (NOTES.md v9, v11): three warpgroups in one 12-warp CTA -- a loader whose loop
    issues the step's 22 cp.async a thread (LDGSTS) and nothing heavier, a converter that converts each e4m3 byte
    once (128 F2FP a 64-row step), a consumer with 68 wgmma a step reading the fp16 slot from shared memory --
    registers moved to the consumer (setmaxnreg), no spill, one CTA a SM (<= 227 KB)."""
    rep = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=True, num_warps=4)
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0 and rep["regs"] <= 168
    assert rep["HGMMA"] == 68 and rep.get("HMMA", 0) == 0 and rep["F2FP"] >= 128
    assert rep["LDGSTS"] == 22 and rep["smem"] <= 227 * 1024
    assert rep["WARPGROUP.DEPBAR"] == 9          # each of its nine wgmma products waited for in turn


def test_gluon_rows_fp8_sm90_dual_build_converts_in_both_consumers_without_spilling():
    """dual_consumers (NOTES.md v17): no converter warpgroup -- two consumer warpgroups with 68 wgmma a step each
    (136 in the build), each converting every e4m3 byte it multiplies in registers (K and V: 2 x 128 F2FP a step
    each, beyond P's packing), one loader with the step's 22 cp.async a thread; registers 208 / 208 / 88
    (setmaxnreg), no spill, one CTA a SM."""
    rep = _sm90_build(rows=True, dual=True, BLOCK_H=16, BLOCK_N=64, STAGES=4, FP8=True, num_warps=4)
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["HGMMA"] == 136 and rep.get("HMMA", 0) == 0 and rep["F2FP"] >= 2 * 256
    assert rep["LDGSTS"] == 22 and rep["smem"] <= 227 * 1024
    assert {88, 208} <= set(rep["setmaxnreg"])


def test_dual_consumers_is_a_form_of_the_fp8_rows_kernel_only():
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    sm90.check_tile(sm90.ROWS_FP8_DUAL_CONFIG, True)
    assert sm90.kernel_of(16, True, rows=True, dual=True) is sm90._sparse_mla_rows_fp8_dual_sm90_kernel
    for cfg, fp8 in (({**sm90.ROWS_CONFIG, "dual_consumers": True}, False),
                     ({**sm90.WGMMA_WS_CONFIG, "dual_consumers": True}, True)):
        with pytest.raises(Glm5labError, match="dual_consumers=True is a form of the fp8_ds_mla rows-as-M kernel"):
            sm90.launch((1, 1, 1), (), cfg, False, fp8)
    for extra in ({"stages": 2}, {"ws_diag": 4, "_diagnostic": True}):
        with pytest.raises(Glm5labError, match="the dual-consumer fp8_ds_mla kernel takes 4 stages"):
            sm90.launch((1, 1, 1), (), {**sm90.ROWS_FP8_DUAL_CONFIG, **extra}, False, True)
    n8 = sm90.ROWS_FP8_PERSISTENT_CONFIG
    sm90.check_tile(n8, True, 8)
    assert n8 == {**sm90.ROWS_FP8_DUAL_CONFIG, "block_h": 8, "pipe": "so", "kept_p": False, "one_item": False}
    for pipe in ("", "o", "so", "s3o3", "op", "sop", "s3o3p"):
        sm90.check_tile({**n8, "pipe": pipe}, True, 8)
    for pipe in ("", "o", "so", "op", "sop"):
        sm90.check_tile({**sm90.ROWS_FP8_DUAL_CONFIG, "pipe": pipe}, True, 16)
    assert [sm90.pipe_bits(p) for p in ("op", "sop", "s3o3p")] == [2 | 16, 1 | 2 | 16, 15 | 16]
    for pipe in ("sopf", "soph", "sopfh", "s3o3pfh", "fh"):                    # (the shorter step, v40)
        sm90.check_tile({**n8, "pipe": pipe}, True, 8)
    sm90.check_tile({**sm90.ROWS_FP8_PAIRED_CONFIG, "pipe": "sopfh"}, True, 16)
    assert [sm90.pipe_bits(p) for p in ("sopf", "soph", "sopfh")] == [19 | 32, 19 | 64, 19 | 32 | 64]
    for cfg in ({**sm90.ROWS_FP8_DUAL_CONFIG, "pipe": "s3o3"}, {**sm90.ROWS_FP8_DUAL_CONFIG, "pipe": "s3o"},
                {**n8, "pipe": "sophf"}, {**n8, "pipe": "fsop"}, {**sm90.ROWS_FP8_DUAL_CONFIG, "pipe": "s3o3fh"},
                {**sm90.ROWS_FP8_DUAL_CONFIG, "pipe": "s3o3p"}, {**n8, "pipe": "ps"}, {**n8, "pipe": "p"},
                {**n8, "pipe": "so3"}, {**n8, "pipe": "sor"}, {**n8, "pipe": "x"},
                {**sm90.ROWS_FP8_CONFIG, "pipe": "o"}, {**sm90.WGMMA_WS_CONFIG, "pipe": "so"}):
        with pytest.raises(Glm5labError, match="pipe='.*': the dual-consumer fp8_ds_mla kernel's products"):
            sm90.check_tile(cfg, True, 8)
    assert sm90.kernel_of(8, True, rows=True, dual=True) is sm90._sparse_mla_rows_fp8_persistent_sm90_kernel
    sm90.check_tile(sm90.ROWS_FP8_DUAL_8_CONFIG, True, 8)                       # (one item a program, v36)
    assert sm90.kernel_of(8, True, rows=True, dual=True, one_item=True) is sm90._sparse_mla_rows_fp8_dual_sm90_kernel
    assert sm90.kernel_of(16, True, rows=True, dual=True, one_item=True) is sm90._sparse_mla_rows_fp8_dual_sm90_kernel
    with pytest.raises(Glm5labError, match="8-head tile takes calls of <= 8 heads, got 9"):
        sm90.check_tile(sm90.ROWS_FP8_DUAL_8_CONFIG, True, 9)
    with pytest.raises(Glm5labError, match="8-head tile takes calls of <= 8 heads, got 9"):
        sm90.check_tile(n8, True, 9)
    with pytest.raises(Glm5labError, match="take 16-head tiles, 64-row steps and 4 warps, got block_h 8"):
        sm90.check_tile({**sm90.ROWS_FP8_CONFIG, "block_h": 8}, True, 8)


def _depbars(rep: dict) -> collections.Counter:
    """How many wgmma waits of a build leave 0 / 1 / 2 products outstanding."""
    return collections.Counter(int(i.rsplit(",", 1)[1], 16) for i in rep["_sass"] if i.startswith("WARPGROUP.DEPBAR"))


@pytest.mark.parametrize("split", [False, True])
def test_gluon_rows_fp8_sm90_persistent_8_head_tile_builds_without_spilling(split):
    """The persistent 8-head kernel (NOTES.md v18) as v19-v35's default ran it: the dual-consumer kernel's two
    consumers (68 wgmma a step each, every e4m3 byte converted in registers twice) and one loader (22 cp.async a step)
    in a loop over work items; registers 208 / 208 / 88, no spill; two q buffers and a merge buffer of its own within
    one CTA's shared memory; both products pipelined (v19): 12 of each step's 18 wgmma waits leave one outstanding."""
    rep = _sm90_build(rows=True, dual=True, BLOCK_H=8, BLOCK_N=64, STAGES=4, SPLIT=split, FP8=True, num_warps=4,
                      _sass=True, PIPE=sparse_mla_sm90.pipe_bits(sparse_mla_sm90.ROWS_FP8_PERSISTENT_CONFIG["pipe"]))
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["HGMMA"] == 2 * 68 and rep["F2FP"] >= 2 * 256 and rep["LDGSTS"] == 22
    assert {88, 208} <= set(rep["setmaxnreg"]) and 200 * 1024 < rep["smem"] <= 227 * 1024
    assert _depbars(rep) == {0: 6, 1: 12}


def test_gluon_rows_fp8_sm90_persistent_8_head_tile_three_in_flight_spills_little():
    """The persistent 8-head kernel with three products in flight on both sides (pipe "s3o3", NOTES.md v20, with
    P^T's tiles re-derived each step, "s3o3p" in v35; v20-v35's default once the top-k was not split): consumers at 224
    registers, the loader at 56, 8 of each step's 18 wgmma waits leave two products outstanding and 4 one; the one
    spill allowed: consumer 1's 3 LDL + 3 STL a step (at 208 registers 40 bytes)."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    rep = _sm90_build(rows=True, dual=True, BLOCK_H=8, BLOCK_N=64, STAGES=4, SPLIT=False, FP8=True, num_warps=4,
                      _sass=True, PIPE=sm90.pipe_bits(sm90.ROWS_FP8_PERSISTENT_DEEP_CONFIG["pipe"]))
    assert {56, 224} <= set(rep["setmaxnreg"]) and rep["HGMMA"] == 2 * 68 and rep["LDGSTS"] == 22
    assert rep["stack"] <= 16 and rep.get("LDL", 0) <= 3 and rep.get("STL", 0) <= 3
    assert _depbars(rep) == {0: 6, 1: 4, 2: 8}


def test_gluon_rows_fp8_sm90_dual_8_head_tile_one_item_a_program_builds_without_spilling():
    """The <= 8-head default since NOTES.md v36: the dual kernel on 8-head tiles, one item a program, "sop" with the
    kept max -- consumers at 224 registers, the loader at 56, no spill, both products of a step's 68 wgmma a consumer,
    and less shared memory than the persistent kernel (no separate handover buffer, one q)."""
    cfg = sparse_mla_sm90.ROWS_FP8_DUAL_8_CONFIG
    rep = _sm90_build(rows=True, dual=True, one_item=True, BLOCK_H=8, BLOCK_N=64, STAGES=4, SPLIT=True, FP8=True,
                      num_warps=4, PIPE=sparse_mla_sm90.pipe_bits(cfg["pipe"]), KEPT_P=cfg["kept_p"])
    assert {56, 224} <= set(rep["setmaxnreg"]) and rep["HGMMA"] == 2 * 68 and rep["LDGSTS"] == 22
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0
    assert rep["smem"] <= 190 * 1024


@pytest.mark.parametrize("pcfg", [PAIR8SOPK, PAIR8S3O3P, PAIR16SOPK], ids=["pair8sopk", "pair8s3o3p", "pair16sopk"])
def test_gluon_paired_tile_builds_for_two_ctas_a_sm(pcfg):
    """The paired kernel (NOTES.md v38): 128 registers a thread at launch and at most half a SM's 228 KB of shared
    memory less the CTA's reserved 1 KB, so that two CTAs of 8 warps share a SM; its consumer at 216 registers, the
    loader at 40 (at 32 the loader spilled), no spill; one consumer's 68 wgmma a step."""
    rep = _sm90_build(rows=True, dual=True, paired=True, BLOCK_H=pcfg["block_h"], BLOCK_N=64, STAGES=2, SPLIT=True,
                      FP8=True, num_warps=4, PIPE=sparse_mla_sm90.pipe_bits(pcfg["pipe"]), KEPT_P=pcfg["kept_p"])
    # (no maxnreg named: the build takes launch's, `build_options`)
    assert rep["regs"] <= 128 and {40, 216} <= set(rep["setmaxnreg"])
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0 and rep["HGMMA"] == 68
    assert 2 * (rep["smem"] + 1024) <= 228 * 1024


def test_paired_tile_is_a_dual_tile_of_two_stages():
    """check_tile refuses a paired tile that is not the dual-consumer kernel's, or has 4 stages (it would not fit
    twice a SM); kernel_of_config picks the paired kernel, and its kept max is on by default."""
    with pytest.raises(Glm5labError, match="paired=True is a form of the dual-consumer"):
        sparse_mla_sm90.check_tile({**sparse_mla_sm90.ROWS_FP8_CONFIG, "paired": True}, True)
    with pytest.raises(Glm5labError, match=r"got stages 4 \(paired\)"):
        sparse_mla_sm90.check_tile({**PAIR8SOPK, "stages": 4}, True, 8)
    for pcfg in (PAIR8SOPK, PAIR16SOPK):
        sparse_mla_sm90.check_tile(pcfg, True, 8)
        assert sparse_mla_sm90.kernel_of_config(pcfg, True) is sparse_mla_sm90._sparse_mla_rows_fp8_paired_sm90_kernel
        assert sparse_mla_sm90.kept_max_pays(True, {k: v for k, v in pcfg.items() if k != "kept_p"})


def test_a_callers_tile_over_a_paired_default_is_paired_only_as_named():
    """resolve_paired, which sparse_mla_attention applies to the caller's _config laid over the default: over the
    paired default a dual tile that names 4 stages runs the dual kernel on one slot a SM, a tile of another kernel is
    not paired, one that names nothing stays paired; paired True named over a dual default takes 2 stages and two
    slots; an explicit paired True with 4 stages is left for check_tile to refuse."""
    sm90 = sparse_mla_sm90
    paired_default = sm90.default_config(8, True, 512)
    dual_default = sm90.default_config(8, True, 64)
    assert paired_default["paired"] and not dual_default["paired"]

    def resolved(default, named):
        return sm90.resolve_paired({**default, **named}, named)

    four = resolved(paired_default, {"dual_consumers": True, "stages": 4})
    assert (four["paired"], four["stages"], four["resident"]) == (False, 4, 1)
    assert sm90.kernel_of_config(four, True) is sm90._sparse_mla_rows_fp8_dual_sm90_kernel
    kept_resident = resolved(paired_default, {"stages": 4, "resident": 3})
    assert (kept_resident["paired"], kept_resident["resident"]) == (False, 3)
    other = resolved(paired_default, sm90.DEFAULT_CONFIG)
    assert not other["paired"] and sm90.kernel_of_config(other, True) is sm90._sparse_mla_fp8_sm90_kernel
    assert resolved(paired_default, {"pipe": "s3o3p"}) == {**paired_default, "pipe": "s3o3p"}
    asked = resolved(dual_default, {"paired": True})
    assert (asked["paired"], asked["stages"], asked["resident"]) == (True, 2, 2)
    assert sm90.kernel_of_config(asked, True) is sm90._sparse_mla_rows_fp8_paired_sm90_kernel
    both = resolved(dual_default, {"paired": True, "stages": 4})
    with pytest.raises(Glm5labError, match=r"got stages 4 \(paired\)"):
        sm90.check_tile(both, True, 8)
    unpaired = resolved(paired_default, {"paired": False})
    assert (unpaired["paired"], unpaired["stages"], unpaired["resident"]) == (False, 4, 1)
    assert sm90.kernel_of_config(unpaired, True) is sm90._sparse_mla_rows_fp8_dual_sm90_kernel
    persistent = resolved(paired_default, {"one_item": False})
    assert (persistent["paired"], persistent["stages"], persistent["resident"]) == (False, 4, 1)
    assert sm90.kernel_of_config(persistent, True) is sm90._sparse_mla_rows_fp8_persistent_sm90_kernel
    for tile in (unpaired, persistent, four, asked):
        sm90.check_tile(tile, True, 8)
    with pytest.raises(Glm5labError, match="one_item=False is the persistent kernel's"):
        sm90.check_tile({**paired_default, "one_item": False}, True, 8)


def test_gluon_rows_fp8_sm90_dual_16_head_tile_pipelines_o_without_spilling():
    """The 16-head dual-consumer tile with O^T's products pipelined (pipe "o", NOTES.md v19) gives its consumers 224
    registers and its loader 56 -- at 208 / 88 it spills -- and leaves one product outstanding in 6 of 18 waits (S^T's
    side synchronous; pipelined too it spills without "p", `test_gluon_rows_fp8_sm90_dual_kept_max_builds`)."""
    rep = _sm90_build(rows=True, dual=True, BLOCK_H=16, BLOCK_N=64, STAGES=4, SPLIT=False, FP8=True, num_warps=4,
                      _sass=True, PIPE=sparse_mla_sm90.pipe_bits("o"))
    assert rep["stack"] == 0 and rep.get("LDL", 0) == 0 and rep["HGMMA"] == 2 * 68 and rep["LDGSTS"] == 22
    assert {56, 224} <= set(rep["setmaxnreg"]) and _depbars(rep) == {0: 12, 1: 6}


@pytest.mark.parametrize("tile", ["16-head-o", "16-head-so", "8-head-so", "16-head-op", "16-head-sop", "8-head-s3o3p"])
def test_gluon_rows_fp8_sm90_dual_kept_max_builds(tile):
    """P^T against the kept max in the dual-consumer kernels (kept_p, NOTES.md v31; the 16-head tile's default): one
    warp vote a consumer step (its uniform branch around the rare path), the same products, and a bounded spill --
    the 16-head "o" form 24 bytes, 3 LDL + 3 STL (none without); its "so" form (v34's default unsplit) 32 bytes,
    11 LDL + 10 STL, S^T's waits leaving one product outstanding as O^T's do; the 8-head "so" form none. With P^T's
    tiles re-derived each step (pipe "p", v35; ptxas had kept their descriptors across the loop and spilled them) the
    16-head forms spill nothing ("op" / "sop": the defaults since v35) and the 8-head "s3o3" (56 bytes without) 16
    bytes, 3 LDL + 3 STL."""
    h, pipe = int(tile.split("-")[0]), tile.split("-")[-1]
    split = tile in ("16-head-o", "8-head-so", "16-head-op")
    rep = _sm90_build(rows=True, dual=True, BLOCK_H=h, BLOCK_N=64, STAGES=4, SPLIT=split, FP8=True, num_warps=4,
                      _sass=True, PIPE=sparse_mla_sm90.pipe_bits(pipe), KEPT_P=True)
    assert rep["HGMMA"] == 2 * 68 and rep["LDGSTS"] == 22 and rep["smem"] <= 227 * 1024
    assert sum(i.startswith("VOTE.ANY") for i in rep["_sass"]) >= 2            # (a consumer's step, each consumer)
    if tile == "16-head-o":
        assert rep["stack"] <= 24 and rep.get("LDL", 0) <= 3 and rep.get("STL", 0) <= 3
        assert {56, 224} <= set(rep["setmaxnreg"]) and _depbars(rep) == {0: 12, 1: 6}
    elif tile == "16-head-so":
        assert rep["stack"] <= 32 and rep.get("LDL", 0) <= 11 and rep.get("STL", 0) <= 10
        assert {56, 224} <= set(rep["setmaxnreg"]) and _depbars(rep) == {0: 6, 1: 12}
    elif tile == "8-head-s3o3p":
        assert rep["stack"] <= 16 and rep.get("LDL", 0) <= 3 and rep.get("STL", 0) <= 3
        assert {56, 224} <= set(rep["setmaxnreg"]) and _depbars(rep) == {0: 6, 1: 4, 2: 8}
    else:
        assert rep["stack"] == 0 and rep.get("LDL", 0) == 0 and rep.get("STL", 0) == 0
        if h == 16:
            assert {56, 224} <= set(rep["setmaxnreg"])
            assert _depbars(rep) == ({0: 6, 1: 12} if pipe == "sop" else {0: 12, 1: 6})


@pytest.mark.parametrize("tile,prmt", [("8-head-s3o3", 160), ("16-head-o-kept", 206)])
def test_gluon_rows_fp8_sm90_dual_v_bytes_ordered_before_conversion(tile, prmt):
    """O^T's operand V^T pairs one latent column of two rows in each register: its bytes are put in that order before
    the conversion (one byte permute for two pairs), so a consumer step's 256 V values take 64 PRMT, not 128 -- the
    build's longest loop (both consumers' steps) at most `prmt` PRMT (NOTES.md v33; v32's builds: 288 / 334, 128
    fewer each) -- with the same 2 x 256 e4m3 conversions in the whole kernel (one consumer step's each) and no more
    spill than v32's (8 heads s3o3: 16 bytes, 16 heads kept: 24)."""
    h, pipe, kept = (8, "s3o3", False) if tile == "8-head-s3o3" else (16, "o", True)
    rep = _sm90_build(rows=True, dual=True, BLOCK_H=h, BLOCK_N=64, STAGES=4, SPLIT=False, FP8=True, num_warps=4,
                      _sass=True, PIPE=sparse_mla_sm90.pipe_bits(pipe), KEPT_P=kept)
    assert rep["PRMT"] <= prmt and sum("F2FP.F16.E4M3" in i for i in rep["_sass"]) == 2 * 256
    assert rep["stack"] <= (16 if h == 8 else 24) and rep["HGMMA"] == 2 * 68


@pytest.mark.parametrize("tokens,splits,num_sms,programs", [(512, 1, 132, 132), (40, 3, 132, 120), (1, 1, 132, 1),
                                                             (300, 2, 78, 78)])
def test_persistent_kernel_launches_one_program_a_sm_over_all_items(monkeypatch, tokens, splits, num_sms, programs):
    """`launch` runs the persistent 8-head kernel on min(items, SMs) programs and tells it the item count (tokens x
    splits); the grid sparse_mla computes (head tiles, tokens, splits) would have left most of them out."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    seen = {}

    class Recorder:
        arg_names = sm90._sparse_mla_rows_fp8_persistent_sm90_kernel.arg_names

        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.update(grid=grid, args=args, **kw)
            return run

    monkeypatch.setattr(sm90, "_sparse_mla_rows_fp8_persistent_sm90_kernel", Recorder())
    sm90.launch((1, tokens, splits), tuple(range(20)), sm90.ROWS_FP8_PERSISTENT_CONFIG, splits > 1, True, num_heads=8,
                num_sms=num_sms)
    assert seen["grid"] == (programs,) and seen["num_items"] == tokens * splits
    assert seen["BLOCK_H"] == 8 and seen["SPLIT"] == (splits > 1) and seen["args"] == tuple(range(20))


def test_gluon_rows_fp8_sm90_timing_diagnostics_build_what_they_name():
    """The warp-specialized kernel's timing diagnostics (ws_diag, NOTES.md v10-11) leave out what they say: loader
    and converter alone have the conversion and no wgmma, the consumer alone its 68 wgmma and no gather, the gathers
    alone neither conversion nor wgmma nor the fp16 ring, converter and consumer without gathers both but no copy."""
    producer = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=True, num_warps=4, DIAG=1)
    consumer = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=True, num_warps=4, DIAG=2)
    gathers = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=True, num_warps=4, DIAG=3)
    no_gathers = _sm90_build(rows=True, BLOCK_H=16, BLOCK_N=64, FP8=True, num_warps=4, DIAG=4)
    assert no_gathers["HGMMA"] == 68 and no_gathers["F2FP"] >= 128 and "LDGSTS" not in no_gathers
    assert "HGMMA" not in producer and producer["F2FP"] >= 128 and producer["LDGSTS"] > 0
    assert consumer["HGMMA"] == 68 and "LDGSTS" not in consumer
    assert "HGMMA" not in gathers and gathers.get("F2FP", 0) < 128 and gathers["LDGSTS"] > 0
    assert gathers["stack"] == 0 and gathers["smem"] < 64 * 1024 < producer["smem"]


def test_gluon_wgmma_ws_sm90_timing_diagnostics_build_what_they_name():
    """The 64-head warp-specialized kernel's diagnostics (NOTES.md v13): the consumers alone keep their 40 wgmma and
    issue no gather, the gathers alone keep the copies and no wgmma, fp8 without its dequantization keeps the 40 wgmma
    and the copies but converts no e4m3 (no more F2FP than the bf16 form: P's packing); the plain build is unchanged
    by the option's existence (its constexpr default is 0)."""
    def build(fp8, diag):
        return _sm90_build(ws=True, BLOCK_H=64, BLOCK_N=64, FP8=fp8, num_warps=8, DIAG=diag)

    plain, bf16 = build(True, 0), build(False, 0)
    consumer, gathers, no_deq = build(True, 2), build(True, 3), build(True, 5)
    assert consumer["HGMMA"] == 40 and "LDGSTS" not in consumer and consumer["F2FP"] == plain["F2FP"]
    assert "HGMMA" not in gathers and gathers["LDGSTS"] == plain["LDGSTS"]
    assert no_deq["HGMMA"] == 40 and no_deq["LDGSTS"] == plain["LDGSTS"]
    assert no_deq.get("F2FP", 0) <= bf16["F2FP"] < plain["F2FP"]
    assert all(r["stack"] <= 8 for r in (consumer, gathers, no_deq))
    assert consumer["smem"] == no_deq["smem"] == plain["smem"] and gathers["smem"] < 96 * 1024   # (q, bf16 tile unused)


def test_gluon_wgmma_cv_sm90_build_dequantizes_in_the_producer():
    """The fp8_ds_mla 64-head kernel with a producer warpgroup (NOTES.md v15): the consumers' build is the bf16
    kernel's (40 wgmma a step, its conversions only), the producer issues the cp.async gathers and converts a
    64-row step's 32,768 e4m3 values (256 F2FP more a thread: e4m3 pairs to f16, f32 pairs to bf16); registers
    moved to the consumers (producer 88, consumers 208), no spill, one CTA a SM (<= 227 KB).
    Its timing diagnostics drop what they skip: d1 no wgmma, d2 no gathers nor conversion, d3 no conversion."""
    cv = _sm90_build(ws=True, converter=True, BLOCK_H=64, BLOCK_N=64, FP8=True, num_warps=8)
    bf16 = _sm90_build(ws=True, BLOCK_H=64, BLOCK_N=64, FP8=False, num_warps=8)
    assert cv["HGMMA"] == 40 and cv["LDGSTS"] > 0 and cv["smem"] <= 227 * 1024 and cv["regs"] <= 168
    assert {88, 208} <= set(cv["setmaxnreg"]) and cv["stack"] == 0
    assert cv["F2FP"] == bf16["F2FP"] + 256
    d1, d2, d3 = (_sm90_build(ws=True, converter=True, BLOCK_H=64, BLOCK_N=64, FP8=True, num_warps=8, DIAG=d)
                  for d in (1, 2, 3))
    assert "HGMMA" not in d1 and d1["LDGSTS"] == cv["LDGSTS"] and d1["F2FP"] == 256
    assert d2["HGMMA"] == 40 and "LDGSTS" not in d2 and d2["F2FP"] == bf16["F2FP"]
    assert "HGMMA" not in d3 and d3["LDGSTS"] == cv["LDGSTS"] and d3.get("F2FP", 0) == 0


def test_gluon_wgmma_cv_sm90_fp16_tile_build_dequantizes_in_fp16():
    """The converter form's fp16 tile (f16_tile, NOTES.md v28): its producer turns e4m3 pairs into fp16 (F2FP) and
    multiplies them by the scale in fp16 (HMUL2: 128 a thread a step for the 64 x 512 tile, and again for chunks 0-1
    of a step outside the power of two's window), instead of through fp32 (the bf16 tile's 256 HADD2.F32, FMUL);
    the same 40 wgmma a step, and the shared memory of one CTA a SM; the step's scales reduced by one warp-wide
    integer max (REDUX, NOTES.md v29); without the power of two (the private switch) the build has fewer
    instructions, no reduction and no second conversion. The fp16 builds spill a little (the default 16 bytes since
    v30's lazy rescale, 24 in v29; without the power of two 24; the bf16 tile's none): a bound, so that more does not
    come unnoticed."""
    base = dict(ws=True, converter=True, BLOCK_H=64, BLOCK_N=64, FP8=True, num_warps=8, P_SMEM=True, PART_F16=True)
    bf16, f16, unsafe = (_sm90_build(**base, **extra, _sass=True) for extra in ({}, {"F16_TILE": True},
                                                                               {"F16_TILE": True, "POW2": False}))
    for rep in (f16, unsafe):
        assert rep["HGMMA"] == 40 and rep["smem"] <= 227 * 1024 and {88, 208} <= set(rep["setmaxnreg"])
        assert rep["HMUL2"] >= 128 and rep.get("HADD2", 0) == 0 < bf16["HADD2"]
    assert bf16.get("HMUL2", 0) == 0 and unsafe["HMUL2"] == 128 < f16["HMUL2"] and unsafe["F2FP"] < bf16["F2FP"]
    assert unsafe["loop"] < f16["loop"] and f16["REDUX"] == 1 and "REDUX" not in unsafe and "REDUX" not in bf16
    assert bf16["stack"] == 0 and f16["stack"] <= 16 and unsafe["stack"] <= 24
    assert all(_skipped_o_multiplies(rep["_sass"]) == 128 for rep in (bf16, f16, unsafe))     # (the lazy rescale)


def test_fp16_tile_is_the_converter_forms_and_its_default():
    """The fp16 tile is taken by every default converter call (P through shared memory, no timing diagnostic) and
    refused, with the reason, anywhere else (a timing diagnostic of it does not build)."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    cv = sm90.WGMMA_CV_CONFIG
    assert sm90.f16_tile_pays(True, cv)
    assert not sm90.f16_tile_pays(False, cv) and not sm90.f16_tile_pays(True, sm90.WGMMA_WS_CONFIG)
    assert not sm90.f16_tile_pays(True, {**cv, "p_smem": False}) and not sm90.f16_tile_pays(True, {**cv, "ws_diag": 2})
    sm90.check_tile({**cv, "f16_tile": True}, True)
    for cfg, fp8 in (({**sm90.WGMMA_WS_CONFIG, "f16_tile": True}, True), ({**cv, "f16_tile": True}, False),
                     ({**cv, "p_smem": False, "f16_tile": True}, True),
                     ({**cv, "f16_tile": True, "_diagnostic": True, "ws_diag": 2}, True)):
        with pytest.raises(Glm5labError, match="f16_tile=True is the 64-head converter form's option"):
            sm90.check_tile(cfg, fp8)


def test_kept_max_runs_by_default_in_the_fp16_tile():
    """P against the kept max (kept_p, NOTES.md v31): by default in the converter form's fp16 tile at every grid size
    (v32: faster at one wave and at eight, in the interleaved rounds and at sustained load), never in the loader
    form or the bf16 tile, and in the 16-head dual-consumer tile; a kept_p tile of another kernel or of a timing
    diagnostic is refused."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    f16 = {**sm90.WGMMA_CV_CONFIG, "f16_tile": True}
    assert sm90.kept_max_pays(True, f16)
    assert not sm90.kept_max_pays(True, {**f16, "f16_tile": False})
    assert not sm90.kept_max_pays(True, sm90.WGMMA_WS_CONFIG)
    assert not sm90.kept_max_pays(False, f16)
    # ... and elsewhere as its tile says: the 16-head dual-consumer tile yes (v31 call 3), its 8-head tile one item a
    # program yes (v36 call 3), the persistent 8-head kernel no (v31)
    assert sm90.kept_max_pays(True, sm90.ROWS_FP8_DUAL_CONFIG)
    assert sm90.kept_max_pays(True, sm90.ROWS_FP8_DUAL_8_CONFIG)
    assert not sm90.kept_max_pays(True, sm90.ROWS_FP8_PERSISTENT_CONFIG)
    assert not sm90.kept_max_pays(True, sm90.ROWS_FP8_PERSISTENT_DEEP_CONFIG)
    # ... so that the call's effective tile is its default's (v36 call 4's suite ran the 8-head default without it)
    for H, T in ((8, 16), (8, 512), (5, 40), (16, 24), (12, 512)):
        cfg = sm90.default_config(H, True, T)
        assert cfg["kept_p"] and sm90.kept_max_pays(True, cfg), (H, T)
    # an override laid over the 16-head default that leaves its kept_p in place: False where it does not fit (the
    # review of v31: it was inherited, and check_tile refused the call), and under a timing diagnostic
    for over in ({"dual_consumers": False, "stages": 2, "pipe": ""}, {"_diagnostic": True, "ws_diag": 2}):
        merged = {**sm90.ROWS_FP8_DUAL_CONFIG, **over}
        assert not sm90.kept_max_pays(True, merged)
        sm90.check_tile({**merged, "kept_p": False}, True)
    sm90.check_tile({**f16, "kept_p": True}, True)
    sm90.check_tile({**sm90.WGMMA_WS_CONFIG, "kept_p": True}, False)
    sm90.check_tile({**sm90.ROWS_FP8_DUAL_CONFIG, "kept_p": True}, True)           # (and the dual consumers', v31)
    sm90.check_tile({**sm90.ROWS_FP8_PERSISTENT_DEEP_CONFIG, "kept_p": True}, True, 8)
    for cfg, fp8 in (({**f16, "kept_p": True, "p_smem": False, "f16_tile": False}, True),
                     ({**sm90.WGMMA_CONFIG, "kept_p": True}, True), ({**sm90.ROWS_FP8_CONFIG, "kept_p": True}, True),
                     ({**sm90.ROWS_FP8_DUAL_CONFIG, "kept_p": True, "_diagnostic": True, "ws_diag": 2}, True),
                     ({**sm90.WGMMA_WS_CONFIG, "kept_p": True, "_diagnostic": True, "ws_diag": 2}, True)):
        with pytest.raises(Glm5labError, match="kept_p=True is an option of the warp-specialized 64-head consumers"):
            sm90.check_tile(cfg, fp8)


def test_converter_form_runs_by_default_for_long_fp8_splits_only():
    """fp8_ds_mla, 17-128 heads: the converter form where a split covers >= CONVERTER_MIN_ROWS rows (NOTES.md v15:
    faster from 16 steps a split, slower at 4-8), the loader form below, never for bf16/fp16 or other tiles."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    ws = sm90.WGMMA_WS_CONFIG
    assert sm90.converter_pays(True, ws, 2048) and sm90.converter_pays(True, ws, sm90.CONVERTER_MIN_ROWS)
    assert not sm90.converter_pays(True, ws, sm90.CONVERTER_MIN_ROWS - 64)
    assert not sm90.converter_pays(False, ws, 2048)
    assert not sm90.converter_pays(True, sm90.WGMMA_CONFIG, 2048)
    assert not sm90.converter_pays(True, sm90.ROWS_FP8_CONFIG, 2048)


@pytest.mark.parametrize("T", [4, 15, 16, 64])
def test_dual_8_head_tile_runs_one_item_unless_named(T, monkeypatch):
    """A caller's dual 8-head tile that does not name one_item runs one (token, split) a program at every batch, as
    the default's does, with the kept max it takes there (before v37 it inherited the default's key: the persistent
    kernel, without the kept max, below FP8_DUAL_MIN_TOKENS_AT_8_HEADS tokens, one item from there); one_item False
    still picks the persistent kernel. The call's resolved tile is read where it reaches `launch` (CPU tensors, an
    sm_90 capability pretended), through the config-level helpers `launch` itself uses."""
    from glm5lab.kernels import sparse_mla as sm

    picked = []

    def launch(grid, args, cfg, split, fp8, *a, **kw):
        sparse_mla_sm90.check_tile(cfg, fp8, 8)
        picked.append((sparse_mla_sm90.kernel_of_config(cfg, fp8), cfg["kept_p"]))

    monkeypatch.setattr(sm, "_compiled_capability", lambda device: (9, 0))
    monkeypatch.setattr(sparse_mla_sm90, "launch", launch)
    q, cache, slots, _ = make_case(T, 8, 128, 4096, torch.bfloat16, "fp8_ds_mla", "cpu", block_size=64)
    tile = {"impl": "gluon", "rows": True, "ws": False, "block_h": 8, "block_n": 64, "num_warps": 4, "stages": 4,
            "dual_consumers": True, "pipe": "sop"}
    dual, persistent = (sparse_mla_sm90._sparse_mla_rows_fp8_dual_sm90_kernel,
                        sparse_mla_sm90._sparse_mla_rows_fp8_persistent_sm90_kernel)
    for over, expected in (({}, (dual, True)), ({"one_item": False, "pipe": "so"}, (persistent, False))):
        sparse_mla_attention(q, cache, slots, SCALE, num_splits=1, _config={**tile, **over})
        assert picked.pop() == expected, (T, over)
    # (the default itself: the paired kernel beyond the SMs -- 8 on CPU --, with its kept max; NOTES.md v38)
    sparse_mla_attention(q, cache, slots, SCALE, num_splits=1, _config={"impl": "gluon"})
    small = sparse_mla_sm90.kernel_of_config(sparse_mla_sm90.default_config(8, True, T, 8), True)
    assert picked.pop() == ((sparse_mla_sm90._sparse_mla_rows_fp8_paired_sm90_kernel, True) if T >= 16 else
                            (small, False)), T


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,converter", [(64, 130, True), (128, 40, True), (64, 8, False), (128, 130, True)])
def test_gpu_default_fp8_64_head_calls_match_reference(H, T, converter, monkeypatch):
    """The default 64-head fp8_ds_mla call (converter form with its fp16 tile at long splits -- 64 x 130, 128 x 40 and
    128 x 130 run unsplit --, P against the kept max with it at every grid size (since v32: 130, 80 and 260 programs),
    the loader form with its bf16 tile at 64 x 8's 16 splits) against the reference of its tile's rounding."""
    seen = []
    launch = sparse_mla_sm90.launch
    monkeypatch.setattr(sparse_mla_sm90, "launch", lambda grid, args, cfg, *a: (
        seen.append((cfg["converter"], cfg.get("f16_tile", False), cfg.get("kept_p", False))),
        launch(grid, args, cfg, *a)))
    q, cache, slots, _ = make_case(T, H, 2048, 65536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out, lse = run_poisoned(q, cache, slots)
    assert seen == [(converter, converter, converter)]          # (the kept max wherever the fp16 tile runs)
    check(out, lse, _tile_ref({"f16_tile": converter})(q, cache, slots), torch.bfloat16)


def test_gluon_converter_form_is_fp8_and_warp_specialized_only():
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    assert sm90.kernel_of(64, True, ws=True, converter=True) is sm90._sparse_mla_wgmma_cv_sm90_kernel
    assert sm90.kernel_of(64, False, ws=True, converter=True) is sm90._sparse_mla_wgmma_ws_sm90_kernel
    with pytest.raises(Glm5labError, match="converter=True is the warp-specialized 64-head kernel's fp8_ds_mla form.*"
                                           "a bf16/fp16 cache"):
        sm90.launch((1, 1, 1), (), dict(sm90.WGMMA_CV_CONFIG), False, False)
    with pytest.raises(Glm5labError, match="ws=False"):
        sm90.launch((1, 1, 1), (), {**sm90.WGMMA_CONFIG, "converter": True}, False, True)
    cv = {**sm90.WGMMA_CV_CONFIG, "_diagnostic": True}
    for diag in (1, 2, 3, 4, 6):
        sm90.check_tile({**cv, "ws_diag": diag}, True)
    for diag in (5, 7):
        with pytest.raises(Glm5labError,
                           match=f"ws_diag {diag} is a private timing diagnostic.*1-4 and 6 of its converter"):
            sm90.launch((1, 1, 1), (), {**cv, "ws_diag": diag}, False, True)


def test_gluon_p_smem_is_a_warp_specialized_option_only():
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    sm90.check_tile({**sm90.WGMMA_WS_CONFIG, "p_smem": True}, False)
    sm90.check_tile({**sm90.WGMMA_CV_CONFIG, "p_smem": True}, True)
    with pytest.raises(Glm5labError, match="p_smem=True is the warp-specialized 64-head kernel's consumer option.*"
                                           "ws=False"):
        sm90.launch((1, 1, 1), (), {**sm90.WGMMA_CONFIG, "p_smem": True}, False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,diag,tile", [("native", 2, "ws64"), ("native", 3, "ws64"), ("fp8_ds_mla", 2, "ws64"),
                                              ("fp8_ds_mla", 3, "ws64"), ("fp8_ds_mla", 5, "ws64"),
                                              ("fp8_ds_mla", 1, "cv64"), ("fp8_ds_mla", 2, "cv64"),
                                              ("fp8_ds_mla", 3, "cv64"), ("fp8_ds_mla", 4, "cv64"),
                                              ("fp8_ds_mla", 6, "cv64"),
                                              ("native", 2, "ws64p"), ("native", 3, "ws64p"),
                                              *(("fp8_ds_mla", d, "cv64p") for d in (1, 2, 3, 4))])
def test_gpu_gluon_wgmma_ws_timing_diagnostics_run_to_completion(layout, diag, tile):
    """Each diagnostic of the warp-specialized 64-head kernels finishes (their handovers still balance: no hang) at a
    real shape with forced splits; its results are wrong on purpose, so only the full kernel's are checked beside
    it."""
    q, cache, slots, ref = make_case(8, 64, 2048, 65536, torch.bfloat16, layout, "cuda", block_size=64)
    cfg = {**{"ws64": WGMMA_WS, "cv64": WGMMA_CV, "ws64p": WGMMA_WSP, "cv64p": WGMMA_CVP}[tile], "_diagnostic": True}
    for splits in (1, 4):
        sparse_mla_attention(q, cache, slots, SCALE, num_splits=splits, _config={**cfg, "ws_diag": diag})
        torch.cuda.synchronize()
    if layout == "fp8_ds_mla":
        ref = _bf16_dequantized_ref(q, cache, slots)
    out, lse = run_poisoned(q, cache, slots, _config=cfg)
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,wcfg", [("native", WGMMA), ("native", WGMMA_WS), ("native", WGMMA_WSP),
                                         ("fp8_ds_mla", WGMMA), ("fp8_ds_mla", WGMMA_WS), ("fp8_ds_mla", WGMMA_CV),
                                         ("fp8_ds_mla", WGMMA_CVP), ("fp8_ds_mla", WGMMA_CV16),
                                         ("fp8_ds_mla", WGMMA_CV16K), ("native", WGMMA_WSPK)],
                         ids=["bf16-wg64", "bf16-ws64", "bf16-ws64p", "fp8-wg64", "fp8-ws64", "fp8-cv64", "fp8-cv64p",
                              "fp8-cv64f16", "fp8-cv64f16k", "bf16-ws64pk"])
@pytest.mark.parametrize("partials", ["fp16", "fp32"])
@pytest.mark.parametrize("H,T,splits", [(64, 8, 16), (128, 4, 8), (33, 3, 5), (64, 2, 32), (128, 2, 32)])
def test_gpu_gluon_wgmma_split_partials_match_reference(layout, wcfg, partials, H, T, splits):
    """The 64-head kernels writing split partials in fp16 (a scale a head, NOTES.md v14; their default) or fp32, the
    separate merge reading them: the usual tolerances at real shapes, a full and a partly filled head tile, two
    64-head tiles; 32 splits: the column merge (one head a program on fp16 partials, v27)."""
    q, cache, slots, ref = make_case(T, H, 2048, 65536, torch.bfloat16, layout, "cuda", block_size=64)
    if layout == "fp8_ds_mla":
        ref = _tile_ref(wcfg)(q, cache, slots)
    out, lse = run_poisoned(q, cache, slots, num_splits=splits, _config={**wcfg, "partials": partials})
    check(out, lse, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("wcfg", [WGMMA_WS, WGMMA_WSP], ids=["ws64", "ws64p"])
def test_gpu_gluon_fp16_partials_keep_values_beyond_fp16_range(wcfg):
    """A bf16 cache reaching 1e6 (q scaled down as much): the warp-specialized kernel's fp16 partials, scaled a head,
    give the reference's output where unscaled fp16 would overflow."""
    q, cache, slots, _ = make_case(8, 64, 2048, 65536, torch.bfloat16, "native", "cuda", block_size=64)
    q, cache = q * 1e-6, cache * 1e6
    ref = tuple(x.cpu() for x in sparse_mla_reference(q, cache, torch.where(slots >= 65536, -1, slots), SCALE))
    assert float(ref[0].abs().max()) > 65504
    out, lse = run_poisoned(q, cache, slots, num_splits=16, _config={**wcfg, "partials": "fp16"})
    check(out, lse, ref, torch.bfloat16)


def test_named_tiles_forced_over_any_default_are_complete():
    """Each named tile of the module, given as _config, replaces every key of the default it is laid over that
    would make another kernel (H200 run v9 call 4: the 32-row tile without "rows": False, forced at 1-8 tokens,
    was laid over the rows-as-M default and refused)."""
    from glm5lab.kernels import sparse_mla_sm90 as sm90

    for name in ("DEFAULT_CONFIG", "ONE_WAVE_CONFIG", "ROWS_CONFIG", "ROWS_FP8_CONFIG", "ROWS_FP8_DUAL_CONFIG",
                 "ROWS_FP8_DUAL_DEEP_CONFIG", "ROWS_FP8_PERSISTENT_CONFIG", "ROWS_FP8_PERSISTENT_DEEP_CONFIG",
                 "ROWS_FP8_DUAL_8_CONFIG", "ROWS_FP8_PAIRED_CONFIG", "ROWS_FP8_PAIRED_8_CONFIG", "WGMMA_CONFIG",
                 "WGMMA_WS_CONFIG", "WGMMA_CV_CONFIG"):
        tile = getattr(sm90, name)
        for fp8 in (False, True):
            if (tile.get("rows") and fp8 != name.startswith("ROWS_FP8")) or (tile.get("converter") and not fp8):
                continue
            for H in (8, 16, 64):
                for T in (1, 8, 17, 132, 133, 512):
                    merged = sm90.resolve_paired({**sm90.default_config(H, fp8, T), **tile}, tile)
                    sm90.check_tile(merged, fp8)
                    assert merged.get("rows", False) == tile.get("rows", False), (name, fp8, H, T)
                    assert merged["ws"] == tile["ws"], (name, fp8, H, T)
                    assert merged["dual_consumers"] == tile["dual_consumers"], (name, fp8, H, T)
                    assert merged["block_h"] == tile["block_h"], (name, fp8, H, T)
                    assert merged["pipe"] == tile["pipe"], (name, fp8, H, T)
                    assert merged["kept_p"] == tile["kept_p"], (name, fp8, H, T)
                    assert merged.get("paired", False) == tile.get("paired", False), (name, fp8, H, T)
                    assert merged["stages"] == tile["stages"], (name, fp8, H, T)
                    assert sm90.kernel_of_config(merged, fp8) is sm90.kernel_of_config(tile, fp8), (
                        name, fp8, H, T)                                   # (v36: one item a program or persistent)


def test_benchmark_tiles_name_every_key_of_a_tile():
    """The kernel benchmark's Gluon variants are laid over the call's default tile, which changes with the batch
    and the layout; each names every key that picks a kernel or its launch, so it times the same tile everywhere."""
    from glm5lab.bench.kernel_bench import GLUON_VARIANTS

    for name, cfg in GLUON_VARIANTS:
        assert {"rows", "ws", "block_h", "block_n", "num_warps", "stages", "resident", "dual_consumers",
                "one_item", "paired"} <= set(cfg), name
        if cfg.get("block_h") == 64:            # (laid over the 64-head default, which has these since v15 / v16)
            assert {"converter", "p_smem"} <= set(cfg), name
