"""The gather-ceiling benchmark's kernel reads what it says (under the interpreter on CPU): each program's column
sums equal torch's over the same random rows, for both row sizes and a top-k that leaves a partial block."""
import pytest
import torch

from glm5lab.bench import gather_ceiling


@pytest.mark.parametrize("block_rows,warps", [(32, 4), (16, 2)])
@pytest.mark.parametrize("layout", sorted(gather_ceiling.ROW_BYTES))
def test_gather_sum_matches_torch(layout, block_rows, warps, device):
    g = torch.Generator().manual_seed(3)
    words = gather_ceiling.ROW_BYTES[layout] // 4
    cache = torch.randint(-1000, 1000, (300, words), dtype=torch.int32, generator=g)
    slots = torch.randint(0, 300, (3, 45), dtype=torch.int32, generator=g)       # 45: full blocks + a partial one
    got = gather_ceiling.gather_sum(cache.to(device), slots.to(device), None, block_rows, warps).cpu()
    blocks = [slots[:, i:i + block_rows] for i in range(0, 45, block_rows)]
    assert got.shape[1] == len(blocks)
    for b, sl in enumerate(blocks):
        want = cache[sl.long()].sum(1, dtype=torch.int32)                       # [tokens, words]
        assert torch.equal(got[:, b, :words], want)
        assert torch.equal(got[:, b, words:], torch.zeros_like(got[:, b, words:]))


def test_gather_ceiling_refuses_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU refusal")
    assert gather_ceiling.main(["--out", str(tmp_path / "g.csv")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a GPU measurement (no CUDA device here)" in err[0], err
    assert not (tmp_path / "g.csv").exists()


@pytest.mark.parametrize("bad", ["32", "24x4", "32x3", "x4", "32x4x1", "0x4"])
def test_gather_ceiling_refuses_a_bad_tile_by_name(bad, tmp_path, capsys):
    assert gather_ceiling.main(["--out", str(tmp_path / "g.csv"), "--tiles", bad]) == 1
    assert "ROWSxWARPS" in capsys.readouterr().err
    assert not (tmp_path / "g.csv").exists()
