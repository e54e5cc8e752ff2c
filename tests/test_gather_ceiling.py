"""The gather-ceiling benchmark's kernel reads what it says (under the interpreter on CPU): each program's column
sums equal torch's over the same random rows, for both row sizes and a top-k that leaves a partial block."""
import pytest
import torch

from glm5lab.bench import gather_ceiling


@pytest.mark.parametrize("layout", sorted(gather_ceiling.ROW_BYTES))
def test_gather_sum_matches_torch(layout, device):
    g = torch.Generator().manual_seed(3)
    words = gather_ceiling.ROW_BYTES[layout] // 4
    cache = torch.randint(-1000, 1000, (300, words), dtype=torch.int32, generator=g)
    slots = torch.randint(0, 300, (3, 45), dtype=torch.int32, generator=g)       # 45 = one full block + 13
    got = gather_ceiling.gather_sum(cache.to(device), slots.to(device)).cpu()
    blocks = [slots[:, :32], slots[:, 32:]]
    for b, sl in enumerate(blocks):
        want = cache[sl.long()].sum(1, dtype=torch.int32)                       # [tokens, words]
        assert torch.equal(got[:, b, :words], want)
        assert torch.equal(got[:, b, words:], torch.zeros_like(got[:, b, words:]))


def test_gather_ceiling_refuses_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU refusal")
    assert gather_ceiling.main(["--out", str(tmp_path / "g.csv")]) == 1
    assert not (tmp_path / "g.csv").exists()
