"""glm5lab.files: whole-file outputs (temporary name beside the target, renamed on success, removed on failure)."""
import os
import re

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

    from glm5lab.files import save_figure

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


def test_plot_and_folder_writers_name_a_folder_they_cannot_make(tmp_path, tiny_paths):
    """Every plot writer goes through save_figure and every folder writer through make_folder: a file standing
    where the folder should be is one line naming it, not matplotlib's or pathlib's OSError after the work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glm5lab.bench import allreduce_model
    from glm5lab.files import save_figure
    from glm5lab.gguf.tokenizer import write_hf_tokenizer

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cannot_make = "^" + re.escape(str(a_file)) + r": cannot make the output folder( \S+)? \(a file is in the way\)$"
    fig, ax = plt.subplots()
    try:
        with pytest.raises(Glm5labError, match=cannot_make):
            save_figure(fig, a_file / "plots" / "x.png")
    finally:
        plt.close(fig)
    with pytest.raises(Glm5labError, match=cannot_make):
        plt.close(allreduce_model.plot(allreduce_model.decode_step_allreduce(), a_file / "tp.png"))
    with pytest.raises(Glm5labError, match=cannot_make):
        write_hf_tokenizer(tiny_paths.gguf("F16"), a_file / "tok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
