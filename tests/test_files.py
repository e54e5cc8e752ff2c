"""glm5lab.files: whole-file outputs (temporary name beside the target, renamed on success, removed on failure)."""
import os

import pytest

from glm5lab.errors import Glm5labError
from glm5lab.files import replacing, temp_beside


@pytest.fixture
def umask_022():
    mask = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(mask)


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if ".tmp" in p.name]


def test_replacing_writes_the_target_with_the_usual_mode(tmp_path, umask_022):
    target = tmp_path / "sub" / "rows.csv"          # the folder is made
    with replacing(target) as tmp:
        assert tmp.parent == target.parent and tmp != target and not target.exists()
        tmp.write_text("a,b\n")
    assert target.read_text() == "a,b\n"
    assert target.stat().st_mode & 0o777 == 0o644
    assert _leftovers(target.parent) == []


def test_replacing_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "book.json"
    target.write_text("old")
    with pytest.raises(ValueError, match="half way"):
        with replacing(target) as tmp:
            tmp.write_text("half")
            raise ValueError("half way")
    assert target.read_text() == "old" and _leftovers(tmp_path) == []


def test_temporary_names_are_unique_and_keep_the_suffix(tmp_path):
    target = tmp_path / "plot.png"
    (fd1, a), (fd2, b) = temp_beside(target), temp_beside(target)
    os.close(fd1)
    os.close(fd2)
    assert a != b and a.name.endswith(".tmp.png") and b.name.endswith(".tmp.png")


def test_matplotlib_picks_the_format_from_the_target(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glm5lab.bench.plots import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    try:
        out = save_figure(fig, tmp_path / "line.svg")
    finally:
        plt.close(fig)
    assert out.read_text().lstrip().startswith("<?xml") and _leftovers(tmp_path) == []


def test_a_folder_as_target_is_refused_before_any_work(tmp_path):
    (tmp_path / "out.csv").mkdir()
    with pytest.raises(Glm5labError, match="is a folder"):
        with replacing(tmp_path / "out.csv"):
            raise AssertionError("the block must not run")
