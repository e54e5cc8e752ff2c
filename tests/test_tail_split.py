"""The tail-split prototype (glm5lab.bench.tail_split): its refusals on the CPU; on the GPU, its result against the
float64 reference (every token, the split ones merged) and that its two grids overlap as planned."""
from __future__ import annotations

import pytest
import torch

from glm5lab.bench import tail_split
from glm5lab.errors import Glm5labError
from tests.test_sparse_mla_kernel import SCALE, check, make_case


@pytest.mark.parametrize("tokens,whole,splits,message", [
    (512, 0, 2, "0 < whole < tokens, got whole 0 of 512"), (512, 512, 2, "got whole 512 of 512"),
    (512, 264, 1, "splits must be 2-16, got 1"), (512, 264, 17, "got 17")])
def test_check_plan_refuses_an_empty_grid_or_a_bad_split(tokens, whole, splits, message):
    with pytest.raises(Glm5labError, match=message):
        tail_split.check_plan(tokens, whole, splits)


def test_paired_tile_is_the_paired_default_of_its_head_count():
    from glm5lab.kernels import sparse_mla_sm90 as sm

    assert tail_split.paired_tile(16) == sm.ROWS_FP8_PAIRED_CONFIG and tail_split.paired_tile(9)["block_h"] == 16
    assert tail_split.paired_tile(8) == sm.ROWS_FP8_PAIRED_8_CONFIG and tail_split.paired_tile(8)["paired"]
    with pytest.raises(Glm5labError, match="1-16 heads, got 64"):
        tail_split.paired_tile(64)


def test_tail_split_script_refuses_bad_plans_before_any_gpu_work(tmp_path, capsys):
    out = tmp_path / "t.csv"
    assert tail_split.main(["--out", str(out), "--plans", "264-2"]) == 1
    assert "--plans takes WHOLExSPLITS" in capsys.readouterr().err
    assert tail_split.main(["--out", str(out), "--plans", "600x2"]) == 1
    assert "got whole 600 of 512" in capsys.readouterr().err
    assert tail_split.main(["--out", str(out), "--heads", "32"]) == 1
    assert "1-16 heads, got 32" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert tail_split.main(["--out", str(out)]) == 1
        assert "needs a GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,whole,splits", [(16, 300, 200, 2), (8, 280, 140, 4), (5, 150, 149, 3)])
def test_gpu_tail_split_matches_the_reference(H, T, whole, splits):
    """Whole tokens, split tokens (-1 padding, an all-invalid token at T // 2, duplicates, a slot past the cache)
    against the float64 reference on the dequantized cache, output poisoned before the call."""
    q, cache, slots, ref = make_case(T, H, 2048, 65_536, torch.bfloat16, "fp8_ds_mla", "cuda", block_size=64)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
    got = tail_split.tail_split_attention(q, cache, slots, SCALE, whole, splits, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    check(out, lse, ref, torch.bfloat16, lse_rel=1e-6)


@pytest.mark.gpu
def test_gpu_tail_split_second_grid_starts_before_the_first_ends():
    """With the first grid letting its dependent launch, the split tokens' programs start on the slots the first
    grid's programs leave, before its last program ends (`stamped_programs`: stamps of both grids on one clock, in a
    replayed CUDA graph -- eager, the host's launch of the second grid can come after the first has ended: 147 us
    after it on the H200)."""
    from glm5lab.bench.power_probe import random_fp8_cache
    from glm5lab.sparse.reference import mla_softmax_scale

    gen = torch.Generator(device="cuda").manual_seed(3)
    cache = random_fp8_cache(262_144, gen)
    T, whole = 512, 264
    q = torch.randn(T, 16, 576, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randint(0, 262_144, (T, 2048), device="cuda", dtype=torch.int32, generator=gen)
    progs = tail_split.stamped_programs(q, cache, slots, mla_softmax_scale(), (whole, 2))
    first = [p[1:] for p in progs if p[0] == 1]
    second = [p[1:] for p in progs if p[0] == 2]
    assert len(first) == whole and len(second) == 2 * (T - whole)
    assert min(a for _, a, _ in second) < max(b for _, _, b in first)
