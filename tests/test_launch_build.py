"""Every launch of glm5lab's kernel host functions built for real GPUs on this CPU machine (scripts/launch_build.py):
the interpreter the other tests run accepts code that ptxas or Triton's compiler refuse, and a tile that no ~100 KB
GPU can hold. The script runs in its own process (the interpreter off there); see tests/offline_build.py."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from glm5lab.kernels import sparse_mla
from glm5lab.kernels.host import SHARED_MEMORY_PER_BLOCK, shared_memory_per_block
from tests.offline_build import ROOT, build_env, run_offline

SCRIPT = str(ROOT / "scripts" / "launch_build.py")


def _rows(stdout: str) -> tuple[list, dict]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if not r.get("summary")], next(r for r in rows if r.get("summary"))


def _side_by_side(*commands) -> list:
    """Run the script with each argument list at once (one process a core); (rc, rows, summary, stderr) each."""
    runs = [subprocess.Popen([sys.executable, SCRIPT, *args, "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=build_env()) for args in commands]
    outs = [p.communicate(timeout=1200) for p in runs]
    return [(p.returncode, *_rows(out), err) for p, (out, err) in zip(runs, outs)]


@pytest.fixture(scope="module")
def builds():
    """Every case for Hopper (sm_90) and Blackwell (sm_120) side by side, then every case for datacenter Blackwell
    (sm_100) beside the fp8 and attention cases for sm_86 (no e4m3 conversion, ~100 KB of shared memory)."""
    return (_side_by_side(["--sm", "90"], ["--sm", "120"])
            + _side_by_side(["--sm", "100"], ["--sm", "86", "--case", "indexer_logits", "sparse_mla"]))


def test_every_kernel_launch_builds_for_hopper_blackwell_and_ampere(builds):
    """Each case's launches build (no compiler error, no host refusal), every *_kernel of the driven modules is
    among them, none needs more shared memory than its GPU has, and on sm_90 the attention runs its Hopper (Gluon)
    kernels as an H100 / H200 does by default."""
    for rc, rows, summary, err in builds:
        assert summary["failed"] == 0 and summary["never_launched"] == [], (summary, err[-2000:])
        assert rc == 0 and rows, err[-2000:]
        assert not [r for r in rows if r["over_smem_limit"]]
    by_sm = {rows[0]["sm"]: rows for _, rows, _, _ in builds}
    assert set(by_sm) == {90, 120, 100, 86}
    for sm in (90, 120, 100):
        kernels = {r["kernel"] for r in by_sm[sm]}
        assert {"_split_hist_kernel", "_split_write_kernel", "_topk_hist_row_kernel", "_topk_hist_kernel",
                "_topk_kernel", "_decode_logits_kernel", "_prefill_logits_kernel", "_paged_mla_decode_kernel",
                "_sparse_mla_fwd_kernel", "_merge_unrolled_kernel", "_merge_columns_kernel"} <= kernels
        # the split write kernel at every block the op or the GPU test takes (v52 call 3: only 1024 compiled)
        assert {r["constexprs"]["BLOCK"] for r in by_sm[sm] if r["kernel"] == "_split_write_kernel"} == {256, 512,
                                                                                                         1024}
    gluon = {r["kernel"] for r in by_sm[90] if r["module"] == "glm5lab.kernels.sparse_mla_sm90"}
    assert {"_sparse_mla_rows_fp8_paired_sm90_kernel", "_sparse_mla_rows_fp8_dual_sm90_kernel",
            "_sparse_mla_wgmma_ws_sm90_kernel", "_sparse_mla_wgmma_cv_sm90_kernel"} <= gluon, gluon
    assert not [r for r in by_sm[120] + by_sm[100] + by_sm[86] if r["module"] == "glm5lab.kernels.sparse_mla_sm90"]
    soft = {r["constexprs"]["SOFT_FP8"] for r in by_sm[86] if r["kernel"] == "_decode_logits_kernel"
            and r["constexprs"]["FP8"]}
    assert soft == {True}        # sm_86 has no e4m3 conversion: only the integer decode is asked for, and builds
    for sm in (90, 120, 100, 86):   # fp8 keys' dot in fp16 (the default) and in q's dtype, on every GPU
        assert {r["constexprs"]["F16"] for r in by_sm[sm] if r["kernel"] == "_decode_logits_kernel"
                and r["constexprs"]["FP8"] and "error" not in r} == {True, False}, sm


def test_the_wide_bf16_tiles_fit_each_gpu(builds):
    """Blackwell SM120 and Ampere SM86 give a block 99 KB of shared memory: the default bf16/fp16 tile for > 32
    heads there is 64 heads x 16 rows (94 KB); Hopper keeps 64 x 64 (216 KB with its wgmma operands); SM100, where
    the 64-head tiles build into a trap, runs 32-head tiles."""
    for _, rows, _, _ in builds:
        sm = rows[0]["sm"]
        plain = [r for r in rows if r["kernel"] == "_sparse_mla_fwd_kernel" and not r["constexprs"]["FP8"]]
        wide = {(r["constexprs"]["BLOCK_N"], r["smem"]) for r in plain if r["constexprs"]["BLOCK_H"] == 64}
        assert {n for n, _ in wide} == {90: {64}, 100: set()}.get(sm, {16}), (sm, wide)
        if sm in (120, 86):   # default_config picks the step from this table: it must be what the builds need
            assert all(smem == sparse_mla.WIDE_BF16_TILE_SHARED_MEMORY[n] for n, smem in wide), (sm, wide)
        assert max(r["smem"] for r in plain) <= SHARED_MEMORY_PER_BLOCK[divmod(sm, 10)]


def test_the_32_head_fp8_tile_needs_what_default_config_assumes(builds):
    """fp8 at 17-32 heads takes the "f16" path where two of its CTAs fit an SM: default_config reads its need from
    F16_32_HEAD_TILE_SHARED_MEMORY, which must be what the sm_90 / sm_100 builds of that tile (e4m3 by cvt) need;
    sm_120 builds the "default" path there, sm_86 (no e4m3) the bit-level "f16" form."""
    for _, rows, _, _ in builds:
        sm = rows[0]["sm"]
        tile = [r for r in rows if r["kernel"] == "_sparse_mla_fwd_kernel" and r["constexprs"]["FP8"]
                and r["constexprs"]["BLOCK_H"] == 32 and r["constexprs"]["BLOCK_N"] == 32]
        forms = {(r["constexprs"]["F16"], r["constexprs"]["CVT"]) for r in tile}
        assert forms == {90: {(True, 1)}, 100: {(True, 1)}, 120: {(False, 1)}, 86: {(True, 2)}}[sm], (sm, forms)
        if sm in (90, 100):
            assert {r["smem"] for r in tile} == {sparse_mla.F16_32_HEAD_TILE_SHARED_MEMORY}, sm
            assert 2 * sparse_mla.F16_32_HEAD_TILE_SHARED_MEMORY <= SHARED_MEMORY_PER_BLOCK[divmod(sm, 10)]


def test_default_config_follows_the_gpus_shared_memory(monkeypatch):
    """default_config(device) on a compiled NVIDIA device reads its capability: at > 32 heads in bf16/fp16 ~100 KB
    GPUs step 16 rows and SM100/103 take 32-head tiles; fp8 at 17-32 heads takes the "f16" path on SM90/SM100 only;
    every other tile is the same everywhere; a CPU device (the interpreter) keeps Hopper's bf16 tiles."""
    cuda = torch.device("cuda")
    for capability, tile in (((9, 0), (64, 64)), ((8, 0), (64, 64)), ((12, 0), (64, 16)), ((8, 9), (64, 16)),
                             ((8, 6), (64, 16)), ((10, 0), (32, 32)), ((10, 3), (32, 32))):
        monkeypatch.setattr(sparse_mla, "_compiled_capability", lambda device, c=capability: c)
        for heads in (33, 64, 128):
            cfg = sparse_mla.default_config(heads, False, cuda)
            assert (cfg["block_h"], cfg["block_n"]) == tile, capability
            if tile[0] == 64:
                assert sparse_mla.WIDE_BF16_TILE_SHARED_MEMORY[tile[1]] <= shared_memory_per_block(capability)
        for heads, fp8 in ((8, False), (16, True), (32, False), (64, True)):
            assert sparse_mla.default_config(heads, fp8, cuda) == sparse_mla.default_config(heads, fp8)
        # fp8 at 17-32 heads: the "f16" path where two of its CTAs fit an SM (SM90 / SM100), "default" elsewhere
        for heads in (17, 24, 32):
            cfg = sparse_mla.default_config(heads, True, cuda)
            assert (cfg["block_h"], cfg["block_n"]) == (32, 32)
            assert cfg.get("fp8_path", "default") == ("f16" if capability[0] in (9, 10) else "default"), capability
    assert sparse_mla.default_config(32, True).get("fp8_path", "default") == "default"     # CPU: unchanged
    monkeypatch.setattr(sparse_mla, "_compiled_capability", lambda device: None)
    assert sparse_mla.default_config(64, False, torch.device("cpu"))["block_n"] == 64
    assert shared_memory_per_block(None) is None and shared_memory_per_block((7, 5)) is None


BAD_KERNEL = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl


    @triton.jit
    def _rebound_kernel(X, Y, n, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        offs = tl.arange(0, BLOCK)                    # one shape before the loop ...
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)
        for start in range(BLOCK, n, BLOCK_K):
            offs = start + tl.arange(0, BLOCK_K)      # ... another inside it: a loop-carried value changes type
            tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


    def copy(x, block, block_k):
        y = torch.empty_like(x)
        _rebound_kernel[(1,)](x, y, x.numel(), BLOCK=block, BLOCK_K=block_k)
        return y


    def both(sm):
        x = torch.randn(3000)
        copy(x, 1024, 1024)
        copy(x, 256, 1024)


    def too_wide(sm):
        from glm5lab.kernels.sparse_mla import sparse_mla_attention
        import launch_build
        q = torch.randn(2, 64, 576, dtype=torch.bfloat16)
        kv = torch.randn(4, 64, 576, dtype=torch.bfloat16)
        slots = torch.randint(-1, 256, (2, 64), dtype=torch.int32)
        cfg = {"impl": "triton", "block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
        with launch_build.sparse_mla_sees(sm):
            launch_build.attempt(sm, "64x64", sparse_mla_attention, q, kv, slots, 0.04, num_splits=1, _config=cfg)


    CASES = {"both": both, "too_wide": too_wide}
''')


def test_a_kernel_the_interpreter_runs_and_the_compiler_refuses_is_reported(tmp_path):
    """The v52 bug's shape: a variable re-bound inside a loop at another block size. The interpreter copies right at
    both sizes; the build of (256, 1024) fails with the compiler's message, (1024, 1024) builds, and the script
    exits 1."""
    path = tmp_path / "rebound_cases.py"
    path.write_text(BAD_KERNEL)
    sys.path.insert(0, str(tmp_path))
    try:
        import rebound_cases
        x = torch.randn(3000)
        for block in (1024, 256):
            assert torch.equal(rebound_cases.copy(x, block, 1024), x)       # TRITON_INTERPRET=1 (tests/conftest.py)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rebound_cases", None)
    done = run_offline([sys.executable, SCRIPT, "--sm", "90", "--cases-from", str(path), "--case", "both", "--json"])
    rows, summary = _rows(done.stdout)
    assert done.returncode == 1 and summary["failed"] == 1, done.stderr[-2000:]
    by_block = {r["constexprs"]["BLOCK"]: r for r in rows}
    assert "error" not in by_block[1024] and by_block[1024]["regs"] > 0
    assert "Loop-carried variable offs" in by_block[256]["error"], by_block[256]


def test_a_tile_over_the_gpus_shared_memory_is_refused_as_on_the_device(tmp_path):
    """A build needing more shared memory than the GPU has raises OutOfResources at its launch, as on the device: the
    sparse-MLA host retries one stage less, then refuses with its own message, which the script reports as a row.
    On sm_90 the same call builds."""
    path = tmp_path / "wide_cases.py"
    path.write_text(BAD_KERNEL)
    done = run_offline([sys.executable, SCRIPT, "--sm", "120", "90", "--cases-from", str(path), "--case", "too_wide",
                        "--json"])
    rows, summary = _rows(done.stdout)
    assert done.returncode == 1 and summary["failed"] == 1, done.stderr[-2000:]
    (refusal,) = [r for r in rows if "host_error" in r]
    assert refusal["sm"] == 120 and "does not fit this GPU's shared memory" in refusal["host_error"]
    sm120 = [r for r in rows if r.get("sm") == 120 and "kernel" in r]
    assert sorted(r["num_stages"] for r in sm120) == [1, 2] and all(r["over_smem_limit"] for r in sm120)
    assert [r["over_smem_limit"] for r in rows if r.get("sm") == 90 and "kernel" in r] == [False]


def test_a_kernel_the_compiler_turns_into_a_trap_is_a_failed_build(tmp_path):
    """Triton 3.6 builds the 64-head bf16 sparse-MLA tile for sm_100 into a bare `trap;` (it cannot place the tile's
    tensor-memory accumulators): ptxas accepts it, every launch would fault. The script reports such a build as
    failed; the same tile builds for sm_90."""
    path = tmp_path / "trap_cases.py"
    path.write_text(BAD_KERNEL)
    done = run_offline([sys.executable, SCRIPT, "--sm", "100", "90", "--cases-from", str(path), "--case", "too_wide",
                        "--json"])
    rows, summary = _rows(done.stdout)
    sm100 = [r for r in rows if r["sm"] == 100]
    assert done.returncode == 1 and sm100 and summary["failed"] == len(sm100), done.stderr[-2000:]
    assert all("compiled to a trap" in r["error"] for r in sm100)
    assert [("error" in r) for r in rows if r["sm"] == 90] == [False]
