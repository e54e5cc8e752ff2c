"""The offline GPU build (scripts/sass_report.py) of the sparse-MLA kernel's default tiles: properties the H200
numbers in results/kernels/NOTES.md rest on, checked without a GPU (Triton's bundled ptxas and cuobjdump).
The script runs in its own process: a real build needs the Triton interpreter off, the rest of the suite on."""

from glm5lab.kernels.sparse_mla import default_config
from tests.offline_build import sass_report


def test_default_fp8_tile_for_8_16_heads_reads_no_bytes_one_at_a_time_and_does_not_spill():
    """sm90 build of the default fp8_ds_mla tile at <= 16 heads ("f16" path, 16x32): the inline-PTX conversion
    keeps Triton from moving the layout change above it, so the main loop has no one-byte shared-memory reads
    (the v4 default had 256 a step) and no register spills."""
    cfg = default_config(8, fp8=True)
    assert cfg["fp8_path"] == "f16"
    (res,) = sass_report({"BLOCK_H": cfg["block_h"], "BLOCK_N": cfg["block_n"], "FP8": True, "F16": True, "CVT": 1,
                          "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, sm=90)
    rep = res["report"]
    assert rep.get("LDS.U8", 0) == 0 and rep["stack"] == 0 and rep["loop"] > 0
    assert rep["HMMA"] > 0 and rep["LDGSTS"] > 0          # tensor cores, and the gathers pipelined by cp.async


def test_fp8_tiles_build_for_sm80_through_the_bit_conversion():
    """Triton 3.6 has no float8e4nv for sm_80: the "default" fp8 path cannot build there, the bit-level "f16"
    path (what sparse_mla_attention runs on such GPUs) builds for the 16- and 64-head tiles."""
    default, f16_16, f16_64 = sass_report(
        {"BLOCK_H": 16, "BLOCK_N": 32, "FP8": True},
        {"BLOCK_H": 16, "BLOCK_N": 32, "FP8": True, "F16": True, "CVT": 2},
        {"BLOCK_H": 64, "BLOCK_N": 32, "FP8": True, "F16": True, "CVT": 2, "num_warps": 8}, sm=80)
    assert "fp8e4nv not supported" in default["error"]
    assert f16_16["report"]["HMMA"] > 0 and f16_64["report"]["HMMA"] > 0


def test_backward_spans_tell_a_partitions_step_loop_from_an_mbarrier_retry_jump(monkeypatch):
    """`backward_spans` on SASS shaped as a warp-specialized kernel's: a loader loop, a consumer step loop closed by a
    conditional branch, and an mbarrier wait's out-of-line retry block that ends in an unconditional jump back into
    the loader. The report's "loop" is the longest backward branch of any kind (that jump: nearly the whole kernel),
    "step_loop" the longest conditional one (the consumer's loop); code without a conditional one has no step_loop."""
    import importlib.util
    import os
    from pathlib import Path

    # (the script pops TRITON_INTERPRET on import, for its real builds: monkeypatch puts it back after the test)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    spec = importlib.util.spec_from_file_location("sass_report_script",
                                                  Path(__file__).parents[1] / "scripts" / "sass_report.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ins = [(0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R4"), (0x110, "@!P1 BRA 0x900"),
           (0x120, "LDGSTS.E [R2], desc[UR6][R4.64]"), (0x200, "@P0 BRA 0x100"),            # the loader's loop
           (0x300, "HGMMA.64x16x16.F32 R24, R32, gdesc[UR8], RZ"), (0x700, "@P4 BRA 0x300"),  # the consumer's
           (0x900, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R4"), (0x910, "@!P1 BRA 0x900"),
           (0x920, "BRA 0x110")]                                                            # the retry block
    assert script.backward_spans(ins) == ((0x110, 0x920), (0x300, 0x700))
    assert script.backward_spans([(0x10, "NOP"), (0x20, "BRA 0x10")]) == ((0x10, 0x20), None)


def test_the_indexer_logits_e4m3_q_and_fragment_order_builds():
    """sm90 builds of the indexer's 128-key fp8 tile with keys . q^T (NOTES.md v57): with a bf16 q the keys reach the
    wgmma's A fragments by 2-byte shared-memory reads and are converted (F2FP); permute_d makes those reads 16-byte
    ones; an e4m3 q takes the fp8 x fp8 wgmma (QGMMA) with nothing converted, in under two thirds of the
    instructions."""
    base = {"indexer_logits": True, "KEYS_AS_M": True}
    bf16_q, permuted, e4m3_q = sass_report({**base, "F16": True}, {**base, "F16": True, "PERMUTE_D": True},
                                           {**base, "FP8_DOT": True}, sm=90)
    bf16_q, permuted, e4m3_q = bf16_q["report"], permuted["report"], e4m3_q["report"]
    assert bf16_q["HGMMA"] > 0 and bf16_q["LDS.U16"] >= 64 and bf16_q["F2FP"] >= 64
    assert permuted.get("LDS.U16", 0) == 0 and permuted["LDS.128"] >= 8
    assert permuted["instructions"] < bf16_q["instructions"]
    assert e4m3_q["QGMMA"] > 0 and "F2FP" not in e4m3_q and "HGMMA" not in e4m3_q
    assert 3 * e4m3_q["instructions"] < 2 * bf16_q["instructions"]
    assert all(r["stack"] == 0 and r["counted"] == "kernel" for r in (bf16_q, permuted, e4m3_q))


def test_the_prefill_logits_keys_as_m_order_keeps_the_heads_sum_out_of_shared_memory():
    """sm90 builds of the prefill logits kernel as glm5lab's vLLM op runs it (e4m3 q on the fp8 pair, 4 tokens x 32
    heads, 64 keys a tile) and with bf16 keys: q . keys^T puts a token's 32 heads on wgmma rows of two warps, so
    their sum is a shared-memory round trip with barriers every key tile; keys . q^T (the Hopper default,
    `prefill_keys_as_m_default`, NOTES.md v60) sums them within a warp -- the same MMA work in under 0.6 of the key
    loop's instructions (753 -> 299 on the pair, 688 -> 366 on bf16 keys), neither spilling."""
    base = {"indexer_prefill": True}
    qk, kq, qk_bf16, kq_bf16 = (r["report"] for r in sass_report(
        base, {**base, "KEYS_AS_M": True}, {**base, "FP8": False, "FP8_DOT": False},
        {**base, "FP8": False, "FP8_DOT": False, "KEYS_AS_M": True}, sm=90))
    assert qk["QGMMA"] == 2 * kq["QGMMA"] > 0 and qk_bf16["HGMMA"] == 2 * kq_bf16["HGMMA"] > 0   # (m64n64 vs n128)
    for a, b in ((qk, kq), (qk_bf16, kq_bf16)):
        assert a["STS"] >= 32 and b["STS"] <= 4 and a["BAR"] > b["BAR"]
        assert 10 * b["loop"] < 6 * a["loop"] and a["counted"] == b["counted"] == "loop"
        assert a["stack"] == b["stack"] == 0
