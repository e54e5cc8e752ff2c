"""The benchmark scripts (`python -m glm5lab.bench.*`) turn a problem the user can fix into ONE line on stderr and
exit status 1 (glm5lab.errors.one_line_errors), never a traceback, and write no output file."""
import runpy
from pathlib import Path

import pytest
import torch

from glm5lab.bench import gather_ceiling, indexer_bench, kernel_bench, latency_anatomy, tensor_parallel
from glm5lab.errors import Glm5labError, one_line_errors

merge_probe = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "merge_probe.py"))["main"]

CASES = [
    (kernel_bench.main, ["--profile", "nope"], "unknown benchmark profile 'nope'"),
    (tensor_parallel.main, ["--world-size", "0"], "world size must be >= 1, got 0"),
    (latency_anatomy.main, ["--sweep", "--configs", "[1]"], "--configs takes JSON objects"),
    (latency_anatomy.main, ["--sweep", "--configs", "{impl: gluon}"], "--configs takes JSON objects"),
    (gather_ceiling.main, ["--tiles", "32x3"], "--tiles takes ROWSxWARPS pairs"),
    (kernel_bench.main, ["--heads", "0"], "--heads takes numbers >= 1"),                 # wrote a 0-head bench before
    (kernel_bench.main, ["--tokens", "-1"], "--tokens takes numbers >= 1"),
]
if not torch.cuda.is_available():
    CASES += [(indexer_bench.main, ["--profile", "gpu"], "needs a CUDA device"),        # a traceback before
              (latency_anatomy.main, [], "needs a GPU"), (latency_anatomy.main, ["--kernels"], "needs a GPU"),
              (gather_ceiling.main, [], "a GPU measurement"), (merge_probe, [], "needs a GPU"),
              (merge_probe, ["--heads", "8", "--columns"], "needs a GPU")]


@pytest.mark.parametrize("main,args,message", CASES, ids=lambda x: getattr(x, "__module__", None) or "")
def test_bench_script_errors_are_one_line(main, args, message, tmp_path, capsys):
    out = tmp_path / "rows.csv"
    assert main(["--out", str(out), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not out.exists()


def test_one_line_errors_passes_other_exceptions_and_results_through():
    @one_line_errors
    def main(argv=None):
        if argv == ["bug"]:
            raise ValueError("a bug keeps its traceback")
        if argv == ["bad"]:
            raise Glm5labError("bad input")
        return 3

    assert main([]) == 3 and main(["bad"]) == 1
    with pytest.raises(ValueError):
        main(["bug"])


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),   # before a ~15 s engine start
    (["env", "--json", "--slug"], "not allowed with argument"),                         # --slug printed alone before
    (["notebooks", "run", "--only"], "expected at least one argument"),                 # ran every notebook before
    (["bench", "--suite", "cpu", "--parts"], "expected at least one argument"),          # ran every part before
])
def test_cli_refuses_meaningless_arguments_at_parse_time(argv, message, capsys):
    from glm5lab.cli import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and message in capsys.readouterr().err


def test_records_archive_refuses_a_negative_keep(tmp_path, capsys):
    from glm5lab.bench import records

    csv = tmp_path / "k.csv"
    records.append_rows(csv, [dict(suite="s", implementation="i", shape="x", metric="m", value=1.0, unit="u")],
                        command="c")
    assert records.main(["archive", str(csv), "--keep", "-1"]) == 2
    assert "keep must be >= 0" in capsys.readouterr().err
    import pandas as pd

    assert len(pd.read_csv(csv)) == 1


def test_script_help_descriptions_end_a_sentence():
    """--help shows the module docstring's first paragraph, not a first line cut mid-sentence."""
    import ast

    from glm5lab.bench import tail_split
    from glm5lab.cli import first_paragraph

    root = Path(__file__).resolve().parents[1]
    docs = {m.__name__: m.__doc__ for m in (kernel_bench, latency_anatomy, gather_ceiling, tail_split)}
    for script in ("prefill_ab", "logits_ab", "topk_ab", "profile_one", "merge_probe"):
        docs[script] = ast.get_docstring(ast.parse((root / "scripts" / f"{script}.py").read_text()))
    for name, doc in docs.items():
        text = " ".join(first_paragraph(doc).split())
        assert text.endswith((".", ":", ")")), (name, text[-60:])


def test_results_given_as_a_file_is_one_line_before_any_work(tmp_path, capsys):
    from glm5lab.cli import main

    file = tmp_path / "results"
    file.write_text("not a folder")
    for argv in (["bench", "--suite", "cpu", "--parts", "projection", "--results", str(file)],
                 ["notebooks", "run", "--results", str(file), "--only", "01"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a file; the results folder must be a folder" in err[0], err
    assert file.read_text() == "not a folder"


def test_an_empty_kernels_csv_holds_no_run(tmp_path, capsys):
    from glm5lab.cli import main

    csv = tmp_path / "bench" / "gpu" / "kernels.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("")
    for flag in ("--targets", "--headline"):
        assert main(["bench", "--suite", "full", flag, "--results", str(tmp_path)]) == 1
        assert "holds no benchmark run" in capsys.readouterr().err


def test_append_rows_checks_every_row_before_writing(tmp_path):
    from glm5lab.bench import records

    csv = tmp_path / "half.csv"
    good = dict(suite="s", implementation="i", shape="x", metric="m", value=1.0, unit="u")
    with pytest.raises(ValueError, match=r"unknown benchmark columns \['typo'\]"):
        records.append_rows(csv, [good, {**good, "typo": 1}], command="c")
    assert not csv.exists()                        # it used to hold the header and the first row


def test_row_counts_pass_over_files_that_are_not_text_csv(tmp_path):
    from glm5lab.bench import records

    good = tmp_path / "a" / "k.csv"
    records.append_rows(good, [dict(suite="s", implementation="i", shape="x", metric="m", value=1.0, unit="u")],
                        command="c")
    (tmp_path / "a" / "binary.csv").write_bytes(b"\xff\xfe\x00\x81 not utf-8")
    assert list(records.row_counts(tmp_path)) == [good]


def test_a_cpu_benchmark_without_the_interpreter_is_refused(monkeypatch):
    from glm5lab.bench.timing import pick_profile

    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels are compiled: nothing to refuse")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(Glm5labError, match="start Python with TRITON_INTERPRET=1"):
        pick_profile({"cpu": {}}, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_profile({"cpu": {}}, "cpu") == ({}, "cpu")
