"""`glm5lab bench`: parts isolated, rows with provenance, cpu rows labeled non-performance, failures
recorded as data, plots drawn from the CSVs."""
import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from glm5lab.bench import attention_stack, suites
from glm5lab.bench.records import COLUMNS
from glm5lab.cli import main
from glm5lab.errors import Glm5labError


@pytest.fixture
def small_stack(monkeypatch):
    """The cpu attention-stack profile cut to one shape, so the interpreter finishes quickly."""
    prof = attention_stack.PROFILES["cpu"]
    monkeypatch.setitem(attention_stack.PROFILES, "cpu", attention_stack.StackProfile(
        prof.shape_kw, ((4, 2, 40),), ("glm5lab", "torch")))


def test_cpu_suite_parts_write_labeled_rows_and_plots(tmp_path, small_stack):
    status = suites.run_suite("cpu", tmp_path, parts=["attention_stack", "projection", "plots"],
                              isolate=False, progress=False)
    assert list(status["value"]) == [1.0, 1.0, 1.0], status["unit"].tolist()
    d = tmp_path / "bench" / "cpu"
    stack = pd.read_csv(d / "attention_stack.csv")
    assert list(stack.columns) == COLUMNS
    assert stack["command"].str.contains("NOT performance").all()
    assert (stack["gpu"] == "no GPU").all()
    got = set(stack[stack.implementation == "glm5lab"].metric)
    assert {"step_time", "attention_time", "attention_share", "stack78_tokens_per_s"} <= got
    share = stack[(stack.metric == "attention_share") & (stack.implementation == "glm5lab")].value.astype(float)
    assert ((share > 0) & (share < 5)).all()
    proj = pd.read_csv(d / "projection.csv")
    # no GPU measurements exist under tmp_path: the projection names what is missing, invents nothing
    assert (proj[proj.implementation == "projection"].metric == "missing_inputs").all()
    assert (proj[proj.implementation != "projection"].metric == "tokens_per_s").any()
    assert (d / "projection_assumptions.csv").exists()
    assert (d / "plots" / "attention_stack.png").stat().st_size > 10_000
    assert (d / "plots" / "projection.png").exists()
    st = pd.read_csv(d / "suite.csv")
    assert set(st.implementation) == {"attention_stack", "projection", "plots"}


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated CUDA error")

    monkeypatch.setitem(suites.PART_FUNCS, "gemm_streaming", boom)
    status = suites.run_suite("cpu", tmp_path, parts=["gemm_streaming", "projection"], isolate=False,
                              progress=False)
    by = dict(zip(status.implementation, status.unit))
    assert by["gemm_streaming"].startswith("failed: RuntimeError: simulated CUDA error")
    assert by["projection"] == "ok"


def test_a_part_that_fails_shows_no_earlier_run_and_fails_the_run(tmp_path, monkeypatch):
    """Notebook 06 used to show a failed part's table from the previous run's rows, and end green. Its tables now
    read the status rows' run only, and require_parts_passed fails the run naming the part."""
    first = suites.run_suite("cpu", tmp_path, parts=["projection", "plots"], isolate=False, progress=False)
    suites.require_parts_passed(first)                                        # all ok: no error
    assert not suites.read_results(tmp_path, "cpu", "projection", run=suites.run_id_of(first)).empty
    import time

    time.sleep(1.1)                                                           # run ids are per second
    monkeypatch.setenv("GLM5LAB_BENCH_INJECT_FAILURE", "projection")
    second = suites.run_suite("cpu", tmp_path, parts=["projection", "plots"], isolate=False, progress=False)
    run = suites.run_id_of(second)
    assert run and run != suites.run_id_of(first)
    assert suites.run_id_of(suites.read_results(tmp_path, "cpu", "suite")) == run     # as notebook 06 reads a GPU run
    assert suites.read_results(tmp_path, "cpu", "projection", run=run).empty
    assert not suites.read_results(tmp_path, "cpu", "projection").empty        # (the latest rows are the first run's)
    with pytest.raises(Glm5labError, match=rf"bench run {run}: projection failed: RuntimeError: injected failure"):
        suites.require_parts_passed(second)
    assert suites.read_part(tmp_path, "cpu", "projection", second).empty       # as notebook 06 reads it
    skipped = suites.run_suite("cpu", tmp_path, parts=["attention_stack"], budget_s=0, isolate=False, progress=False)
    suites.require_parts_passed(skipped)                                      # a budget skip is not a failure
    # a part the run did not include shows its latest run's rows, named
    latest = suites.read_part(tmp_path, "cpu", "projection", skipped)
    assert not latest.empty and latest.attrs["run"] == suites.run_id_of(first)


def test_spent_budget_skips_device_parts_but_not_the_projection(tmp_path):
    status = suites.run_suite("cpu", tmp_path, parts=["attention_stack", "projection"], budget_s=0,
                              isolate=False, progress=False)
    by = dict(zip(status.implementation, status.unit))
    assert by["attention_stack"].startswith("skipped")
    assert by["projection"] == "ok"


def test_isolated_child_failure_does_not_stop_the_suite(tmp_path, monkeypatch):
    """Each part runs in its own process: one that dies (here by injected failure) is a 'failed' row and
    the next part runs in a fresh process."""
    monkeypatch.setenv("GLM5LAB_BENCH_INJECT_FAILURE", "projection")
    monkeypatch.setenv("GLM5LAB_OUTER_COMMAND", "bash scripts/gpu_run.sh bench")
    status = suites.run_suite("cpu", tmp_path, parts=["projection", "plots"], budget_s=300, isolate=True,
                              progress=False)
    by = dict(zip(status.implementation, status.unit))
    assert by["projection"].startswith("failed: exit code")
    assert by["plots"] == "ok"
    # every row names the command that reruns it, the child's part rows as the suite's status rows
    run = suites.run_id_of(status)
    again = "glm5lab bench --suite cpu --parts projection plots --budget 300 (via bash scripts/gpu_run.sh bench)"
    assert set(status.command) == {f"{again} run={run} (cpu profile: timings are NOT performance)"}
    monkeypatch.delenv("GLM5LAB_BENCH_INJECT_FAILURE")
    assert suites.main(["--part", "projection", "--profile", "cpu", "--results", str(tmp_path), "--run-id", run,
                        "--invocation", again]) == 0        # the child's entry, as run_suite starts it
    rows = pd.read_csv(tmp_path / "bench" / "cpu" / "projection.csv")
    assert set(rows.command) == {f"{again} part=projection run={run} (cpu profile: timings are NOT performance)"}


def test_latest_run_picks_the_newest_run_id():
    df = pd.DataFrame({"command": ["x run=20260101T000000Z", "x run=20260102T000000Z", "y run=20260102T000000Z"],
                       "value": [1, 2, 3]})
    assert suites.latest_run(df)["value"].tolist() == [2, 3]


def test_cli_full_suite_without_gpu_is_a_one_line_error(capsys):
    assert main(["bench", "--suite", "full", "--parts", "projection"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU" not in err[0] and "GPU" in err[0]


def test_results_default_to_the_checkouts_from_any_folder(tmp_path, monkeypatch, capsys):
    """`bench --targets` (and `doctor --matrix`) used to read ./results of wherever they ran: from another folder the
    committed GPU run was "missing", and the advice was to rerun the suite on a GPU."""
    from pathlib import Path

    from glm5lab.env import default_results_dir

    repo = Path(__file__).resolve().parents[1]
    assert default_results_dir() == repo / "results"
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--suite", "full", "--targets"]) == 0
    assert "of 22; unmeasured" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_cli_targets_prints_issue_7s_targets_from_the_last_gpu_run_or_one_line_why_not(tmp_path, capsys):
    """`glm5lab bench --suite full --targets` runs nothing: it prints kernel_plots.targets_table of the last kernels
    run under --results, with how many targets are met; `--headline` prints the README's kernel table of the same
    run; without such a run, or with the cpu suite, one line."""
    from glm5lab.bench.records import append_rows

    rows = [{"suite": "sparse_mla_kernel", "implementation": "glm5lab", "shape": "H8_T1_K2048", "dtype": "bf16",
             "layout": "fp8_ds_mla", "metric": "time_graph_interleaved", "value": 5.5, "unit": "us"},
            {"suite": "sparse_mla_kernel", "implementation": "glm5lab", "shape": "H8_T8_K2048", "dtype": "bf16",
             "layout": "fp8_ds_mla", "metric": "time_graph", "value": 9.5, "unit": "us"}]
    append_rows(suites.out_dir(tmp_path, "gpu") / "kernels.csv", rows, command="x part=kernels run=20260101T000000Z")
    assert main(["bench", "--suite", "full", "--targets", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "met 1 of 22; unmeasured 20" in out and "interleaved" in out and "graph" in out
    assert not (suites.out_dir(tmp_path, "gpu") / "suite.csv").exists()          # nothing ran
    assert main(["bench", "--suite", "full", "--headline", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| cache, heads |") and out[6].startswith("| fp8_ds_mla, 8 | 5.5 µs | 9.5 µs | n/a")
    empty = tmp_path / "empty"
    suites.out_dir(empty, "gpu").mkdir(parents=True)
    (suites.out_dir(empty, "gpu") / "kernels.csv").write_text(",".join(COLUMNS) + "\n")     # a header, no run
    alien = tmp_path / "alien"
    suites.out_dir(alien, "gpu").mkdir(parents=True)
    (suites.out_dir(alien, "gpu") / "kernels.csv").write_text("a,b\n1,2\n")                # not a benchmark CSV
    for argv in [[*ask, *case] for ask in (["--targets"], ["--headline"])
                 for case in (["--suite", "full", "--results", str(tmp_path / "none")],
                              ["--suite", "full", "--results", str(empty)],
                              ["--suite", "full", "--results", str(alien)],
                              ["--suite", "cpu", "--results", str(tmp_path)])]:
        assert main(["bench", *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and any(m in err[0] for m in ("no GPU kernel benchmark", "no benchmark run",
                                                            "not a benchmark CSV", "--suite full"))


def test_a_git_sha_that_looks_like_a_number_reads_back_as_text(tmp_path, monkeypatch):
    """records.read (and every reader of the bench CSVs through it: kernel_plots.last_run, the plots' captions) keeps
    the provenance's text columns as text: pandas alone reads the SHA 7e8792557537 (a commit of v39's) as a float,
    inf, and 123456789012 as an integer."""
    from glm5lab.bench import kernel_plots, records

    row = {"suite": "sparse_mla_kernel", "implementation": "glm5lab", "shape": "H8_T1_K2048", "dtype": "bf16",
           "layout": "fp8_ds_mla", "metric": "time", "value": 7.0, "unit": "us"}
    for sha in ("7e8792557537", "123456789012"):
        path = tmp_path / f"{sha}.csv"
        monkeypatch.setenv("GLM5LAB_GIT_SHA", sha)
        records.append_rows(path, [row], command="x")
        assert records.read(path)["git_sha"].tolist() == [sha]
        assert kernel_plots.last_run(path)[1]["git_sha"] == sha


def test_unknown_part_is_refused(tmp_path):
    from glm5lab.errors import Glm5labError

    with pytest.raises(Glm5labError, match="unknown part"):
        suites.run_suite("cpu", tmp_path, parts=["nope"], isolate=False, progress=False)


def test_archive_moves_older_runs_to_a_gzipped_history_and_keeps_the_latest(tmp_path, capsys):
    """`records.archive_older_runs`: the CSV keeps its last run (readers see the same latest run), every older row
    lands once in <name>_history.csv.gz across two archivings, and a non-benchmark CSV is refused untouched."""
    from glm5lab.bench.records import append_rows, archive_older_runs
    from glm5lab.bench.records import main as records_main

    csv = tmp_path / "kernels.csv"
    row = {"suite": "s", "implementation": "glm5lab", "shape": "H8_T1", "metric": "time", "unit": "us"}
    for i, run in enumerate(("run=A", "run=B", "run=C")):
        append_rows(csv, [{**row, "value": 10 * i + j} for j in range(3)], command=f"bench {run}")
    latest, before = suites.latest_run(pd.read_csv(csv)), csv.read_bytes()
    assert archive_older_runs(csv, keep=2) == 3
    assert records_main(["archive", str(csv)]) == 0
    hist = pd.read_csv(tmp_path / "kernels_history.csv.gz")
    now = pd.read_csv(csv)
    assert list(hist.value) == [0, 1, 2, 10, 11, 12] and list(hist.columns) == COLUMNS
    assert list(now.value) == [20, 21, 22] and now.equals(latest.reset_index(drop=True))
    assert archive_older_runs(csv) == 0
    header, rest = csv.read_bytes().split(b"\n", 1)      # history + what is left = the file as it was, byte for byte
    assert gzip.decompress((tmp_path / "kernels_history.csv.gz").read_bytes()) + rest == before
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="is not a benchmark CSV"):
        archive_older_runs(other)
    assert other.read_text() == "a,b\n1,2\n" and not (tmp_path / "other_history.csv.gz").exists()
    capsys.readouterr()
    for bad, why in ((other, "is not a benchmark CSV"), (tmp_path / "missing.csv", "no benchmark CSV at")):
        assert records_main(["archive", str(bad)]) == 2      # the CLI: one line, no traceback
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1


def test_cli_count_then_archive_appended_keeps_each_csv_s_new_run_even_after_an_inner_archiving(tmp_path, capsys):
    """`records count` before a GPU call's parts and `records archive-appended` after them (scripts/gpu_run.sh): a
    CSV a part appended to keeps that part's rows, the rows it held go to its history; a CSV the main job inside
    the call (the notebooks part) archived already is left alone -- its row count grew past the old one, but
    re-archiving would move the new run's first rows; an untouched CSV, a new one and a probe's CSV stay as they
    were; a count file that is not one is refused in one line."""
    from glm5lab.bench import records

    root = tmp_path / "results"
    (root / "bench").mkdir(parents=True)
    row = {"suite": "s", "implementation": "glm5lab", "shape": "H8", "metric": "time", "unit": "us"}

    def add(name, values):
        records.append_rows(root / name, [{**row, "value": v} for v in values], command=f"bench {name}")

    add("bench/kernels.csv", [1, 2])
    add("bench/untouched.csv", [5])
    add("notebook.csv", [3, 4])
    (root / "probe.csv").write_text(",".join(records.COLUMNS + ["call"]) + "\n" + "," * len(records.COLUMNS) + "0\n")
    counts = tmp_path / "rows_before.json"
    assert records.main(["count", str(root), "--out", str(counts)]) == 0
    assert set(json.loads(counts.read_text())) == {"bench/kernels.csv", "bench/untouched.csv", "notebook.csv"}
    before = {p: p.read_bytes() for p in root.rglob("*.csv")}
    add("bench/kernels.csv", [6, 7, 8])                      # the bench part
    inner = records.row_counts(root)                         # the notebooks part: a main job of its own
    add("notebook.csv", [9, 10, 11])
    assert records.archive_appended(root, inner) == {root / "notebook.csv": 2}
    add("bench/new.csv", [12])
    capsys.readouterr()
    assert records.main(["archive-appended", str(root), "--since", str(counts)]) == 0
    assert "kernels.csv: 2 rows of earlier runs -> kernels_history.csv.gz" in capsys.readouterr().out
    values = {p.relative_to(root).as_posix(): records.read(p)["value"].tolist() for p in root.rglob("*.csv")
              if p.name != "probe.csv"}
    assert values == {"bench/kernels.csv": [6, 7, 8], "bench/untouched.csv": [5], "notebook.csv": [9, 10, 11],
                      "bench/new.csv": [12]}
    assert records.read(root / "bench" / "kernels_history.csv.gz")["value"].tolist() == [1, 2]
    assert records.read(root / "notebook_history.csv.gz")["value"].tolist() == [3, 4]
    for p in (root / "bench" / "untouched.csv", root / "probe.csv"):
        assert p.read_bytes() == before[p]
    assert sorted(h.name for h in root.rglob("*_history.csv.gz")) == ["kernels_history.csv.gz",
                                                                      "notebook_history.csv.gz"]
    for bad in ("[1, 2]", "{\"kernels.csv\": 3}", "not json"):
        counts.write_text(bad)
        assert records.main(["archive-appended", str(root), "--since", str(counts)]) == 2
        err = capsys.readouterr().err
        assert "is not a row count file written by `count`" in err and len(err.strip().splitlines()) == 1
    assert records.main(["count", str(tmp_path / "nowhere"), "--out", str(counts)]) == 2
    assert "no results folder at" in capsys.readouterr().err


def test_gpu_run_seeds_the_committed_results_only_on_the_gpu_model_that_made_them(tmp_path, monkeypatch, capsys):
    """A call for an H200 may be given an H100: seeded, its rows would be appended to the H200's CSVs and read as
    their latest run. `records same-gpu` compares this machine's GPU with the latest rows' (exit 0 / 1), and
    scripts/gpu_run.sh, run here on a machine without the committed results' GPU, starts from an empty tree."""
    import os
    import subprocess
    import sys
    import tarfile

    from glm5lab.bench import records

    csv = tmp_path / "kernels.csv"
    row = {"suite": "s", "implementation": "glm5lab", "shape": "H8", "metric": "time", "unit": "us", "value": 1}
    monkeypatch.setattr(records, "collect", lambda: {"gpu": "NVIDIA H200", "git_sha": "a" * 12})
    records.append_rows(csv, [row])
    monkeypatch.setattr(records, "collect", lambda: {"gpu": "NVIDIA H100 80GB HBM3", "git_sha": "b" * 12})
    records.append_rows(csv, [row])                          # the latest rows: the H100's
    for here, status in (("NVIDIA H100 80GB HBM3", 0), ("NVIDIA H200", 1), ("no GPU", 1)):
        monkeypatch.setattr("glm5lab.env.gpu_info", lambda here=here: {"gpu": here})
        assert records.main(["same-gpu", str(csv)]) == status
        out = capsys.readouterr().out
        assert f"this machine has {here}: " + ("another model" if status else "the same model") in out
    assert records.main(["same-gpu", str(tmp_path / "none.csv")]) == 0     # nothing committed: seeding is harmless

    repo = Path(__file__).resolve().parents[1]
    if records.seed_tree(repo / "results")[0] is not None:
        pytest.skip("this machine's GPU model has committed results (results/ or results/<gpu>/)")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GLM5LAB_GIT_SHA": "0" * 12}
    run = subprocess.run(["bash", "scripts/gpu_run.sh", "nothing"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not seeding the committed results" in run.stdout
    with tarfile.open(out / "gpu_results_nothing.tar.gz") as tar:
        files = [m.name for m in tar.getmembers() if m.isfile()]
    assert "gpu/gpu_run.log" in files and not [n for n in files if n.startswith("gpu/results/")]


def test_a_gpu_call_seeds_from_the_committed_tree_of_its_own_gpu_model(tmp_path, monkeypatch, capsys):
    """results/ holds the H200's runs, results/<gpu>/ another model's (results/h100/). `records seed-tree` names the
    tree of this machine's model (exit 0) or none (exit 1), and gpu_run.sh copies that tree into the call's results:
    a notebooks call on an H100 reads the H100's suite, not the H200's and not nothing."""
    import os
    import subprocess
    import sys
    import tarfile

    from glm5lab.bench import records

    row = {"suite": "s", "implementation": "glm5lab", "shape": "H8", "metric": "time", "unit": "us", "value": 1}
    repo = tmp_path / "repo"
    for tree, gpu in (("results", "NVIDIA H200"), ("results/h100", "NVIDIA H100 80GB HBM3"),
                      ("results/cpu", "no GPU")):
        monkeypatch.setattr(records, "collect", lambda gpu=gpu: {"gpu": gpu, "git_sha": "a" * 12})
        records.append_rows(repo / tree / "bench" / "gpu" / "kernels.csv", [row])
    for here, want in (("NVIDIA H200", "results"), ("NVIDIA H100 80GB HBM3", "results/h100"),
                       ("no GPU", "results/cpu"), ("NVIDIA B200", None)):
        monkeypatch.setattr("glm5lab.env.gpu_info", lambda here=here: {"gpu": here})
        tree, line = records.seed_tree(repo / "results")
        assert tree == (repo / want if want else None), (here, line)
        assert records.main(["seed-tree", str(repo / "results")]) == (0 if want else 1)
        out, err = capsys.readouterr()
        assert out.strip() == (str(repo / want) if want else "") and f"this machine has {here}" in err
    assert records.main(["seed-tree", str(tmp_path / "none")]) == 2

    # the script itself, on this GPU-less machine: it seeds from results/cpu/ (the "no GPU" model's tree) alone
    src = Path(__file__).resolve().parents[1]
    (repo / "scripts").mkdir()
    (repo / "scripts" / "gpu_run.sh").write_text((src / "scripts" / "gpu_run.sh").read_text())
    (repo / "glm5lab").symlink_to(src / "glm5lab")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GLM5LAB_GIT_SHA": "0" * 12}
    run = subprocess.run(["bash", "scripts/gpu_run.sh", "nothing"], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "seeding from results/cpu/" in run.stdout
    with tarfile.open(tmp_path / "out" / "gpu_results_nothing.tar.gz") as tar:
        seeded = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                  if m.isfile() and m.name.startswith("gpu/results/")}
    assert list(seeded) == ["gpu/results/bench/gpu/kernels.csv"] and ",no GPU," in seeded[
        "gpu/results/bench/gpu/kernels.csv"]


def test_a_csv_from_before_gpu_uuid_is_read_appended_and_archived_with_the_new_header(tmp_path, monkeypatch):
    """The board's UUID is a provenance column (lent H200s differ by 3-5%). The committed CSVs predate it: they
    read back with the column empty, an append rewrites the file under the current header first (else the new
    rows' values would sit under the old names), and archiving conforms an older history the same way."""
    from glm5lab.bench import kernel_plots, records

    real = records.collect
    monkeypatch.setattr(records, "collect", lambda: {**real(), "gpu": "NVIDIA H200", "capability": "9.0",
                                                      "gpu_uuid": "GPU-0000aaaa", "git_sha": "b" * 12})
    old_cols = [c for c in COLUMNS if c != "gpu_uuid"]
    row = {"suite": "sparse_mla_kernel", "implementation": "glm5lab", "shape": "H8_T1_K2048", "dtype": "bf16",
           "layout": "fp8_ds_mla", "metric": "time", "unit": "us"}
    csv = tmp_path / "kernels.csv"
    old = pd.DataFrame([{**row, "value": v, "gpu": "NVIDIA H200", "git_sha": "a" * 12, "command": "bench old",
                         "timestamp": "t0"} for v in (7.0, 7.5)]).reindex(columns=old_cols)
    old.to_csv(csv, index=False)
    hist = tmp_path / "kernels_history.csv.gz"
    hist.write_bytes(gzip.compress(old.assign(value=[9.0, 9.5], git_sha="c" * 12).to_csv(index=False).encode()))
    got = records.read(csv)
    assert "gpu_uuid" in got and got["gpu_uuid"].isna().all() and kernel_plots.last_run(csv)[1]["git_sha"] == "a" * 12
    records.append_rows(csv, [{**row, "value": 6.5}], command="bench new")
    assert csv.read_text().splitlines()[0] == ",".join(COLUMNS)
    got = records.read(csv)
    assert got["value"].tolist() == [7.0, 7.5, 6.5]
    assert got["gpu_uuid"].fillna("").tolist() == ["", "", "GPU-0000aaaa"]
    assert got["git_sha"].tolist() == ["a" * 12] * 2 + ["b" * 12]
    assert kernel_plots.last_run(csv)[1]["gpu_uuid"] == "GPU-0000aaaa"
    assert records.archive_older_runs(csv) == 2
    h = pd.read_csv(hist, dtype=str, keep_default_na=False)
    assert list(h.columns) == COLUMNS and h["value"].tolist() == ["9.0", "9.5", "7.0", "7.5"]
    assert records.read(csv)["gpu_uuid"].tolist() == ["GPU-0000aaaa"]
    assert records.archive_older_runs(csv) == 0
    bad = tmp_path / "bad.csv"
    bad.write_text(",".join(old_cols + ["mystery"]) + "\n")
    with pytest.raises(ValueError, match="is not a benchmark CSV"):
        records.append_rows(bad, [{**row, "value": 1.0}])
    assert bad.read_text() == ",".join(old_cols + ["mystery"]) + "\n"


def test_projection_assumptions_csv_names_the_gpu_of_its_inputs(tmp_path, monkeypatch):
    from glm5lab.bench import projection

    real = projection.project

    def fed_by_an_h100(**kw):
        proj = real(**kw)
        proj["measured_on"] = "NVIDIA H100 80GB HBM3"
        return proj

    monkeypatch.setattr(projection, "project", fed_by_an_h100)
    suites.run_suite("cpu", tmp_path, parts=["projection"], isolate=False, progress=False)
    a = pd.read_csv(tmp_path / "bench" / "cpu" / "projection_assumptions.csv").set_index("quantity")
    assert a.loc["efficiencies", "value"] == "NVIDIA H100 80GB HBM3 full suite"
    assert a.command.str.contains("part=projection").all() and a.timestamp.notna().all()
