"""The benchmark scripts (`python -m glm5lab.bench.*`) turn a problem the user can fix into ONE line on stderr and
exit status 1 (glm5lab.errors.one_line_errors), never a traceback, and write no output file."""
import runpy
from pathlib import Path

import pytest
import torch

from glm5lab.bench import gather_ceiling, kernel_bench, latency_anatomy, tensor_parallel
from glm5lab.errors import Glm5labError, one_line_errors

merge_probe = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "merge_probe.py"))["main"]

CASES = [
    (kernel_bench.main, ["--profile", "nope"], "unknown benchmark profile 'nope'"),
    (tensor_parallel.main, ["--world-size", "0"], "world size must be >= 1, got 0"),
    (latency_anatomy.main, ["--sweep", "--configs", "[1]"], "--configs takes JSON objects"),
    (latency_anatomy.main, ["--sweep", "--configs", "{impl: gluon}"], "--configs takes JSON objects"),
    (gather_ceiling.main, ["--tiles", "32x3"], "--tiles takes ROWSxWARPS pairs"),
]
if not torch.cuda.is_available():
    CASES += [(latency_anatomy.main, [], "needs a GPU"), (latency_anatomy.main, ["--kernels"], "needs a GPU"),
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
