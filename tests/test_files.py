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


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no text for this value")

    __repr__ = __str__


def test_write_table_writes_whole_csv_and_gzip_by_suffix(tmp_path):
    import gzip

    import pandas as pd

    from glm5lab.files import write_table

    df = pd.DataFrame({"shape": ["H8_T1", "H16_T8"], "value": [7.25, 12.5]})
    plain = write_table(df, tmp_path / "rows.csv")
    packed = write_table(df, tmp_path / "rows.csv.gz")
    assert plain.read_text().splitlines()[0] == "shape,value"           # no index column
    assert gzip.decompress(packed.read_bytes()).decode() == plain.read_text()
    pd.testing.assert_frame_equal(pd.read_csv(packed), df)
    assert _leftovers(tmp_path) == []


def test_write_table_and_write_json_keep_the_old_file_when_writing_fails(tmp_path):
    """A value that cannot be written (here one whose str() raises, rows into the table) leaves the old file as it
    was and no temporary file beside it."""
    import pandas as pd

    from glm5lab.files import write_json, write_table

    table, book = tmp_path / "t.csv", tmp_path / "b.json"
    table.write_text("old table\n")
    book.write_text("old book\n")
    bad = pd.DataFrame({"a": list(range(5000)), "b": ["x"] * 4999 + [_Unprintable()]})
    with pytest.raises(RuntimeError, match="no text"):
        write_table(bad, table)
    with pytest.raises(RuntimeError, match="no text"):
        write_json({"rows": [1, 2], "bad": _Unprintable()}, book)
    assert table.read_text() == "old table\n" and book.read_text() == "old book\n"
    assert _leftovers(tmp_path) == []


def test_write_json_writes_paths_and_numbers_as_json_has_them(tmp_path):
    import json

    import numpy as np

    from glm5lab.files import write_json

    import torch

    out = write_json({"path": tmp_path / "x.gguf", "n": np.int64(3), "f": np.float32(0.5), "t": torch.tensor(2.0),
                      "v": np.arange(2)}, tmp_path / "sub" / "o.json")
    assert json.loads(out.read_text()) == {"path": str(tmp_path / "x.gguf"), "n": 3, "f": 0.5, "t": 2.0,
                                           "v": "[0 1]"}


def test_notebooks_write_their_outputs_through_glm5lab_files():
    """Notebook outputs are written whole by glm5lab.files (write_table, write_json, save_figure), never by a
    notebook's own to_csv / write_text / json.dump / savefig, which leave half a file when a run stops."""
    import json
    from pathlib import Path

    writers = re.compile(r"\.to_csv\(|\.write_text\(|\.write_bytes\(|json\.dump\(|\.savefig\(|open\([^)]*['\"]w")
    found = []
    for nb in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                found += [f"{nb.name} cell {i}: {line.strip()}" for line in "".join(cell["source"]).splitlines()
                          if writers.search(line)]
    assert found == []
