"""The foundation: installable package, CLI, environment consistency, vLLM importability, notebook runner."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import nbformat
import pytest
import yaml

from glm5lab.errors import Glm5labError
from glm5lab.notebooks import run_all

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm5lab", *args], capture_output=True, text=True,
                          timeout=300)


def test_version_and_env_cli():
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"glm5lab {metadata.version('glm5lab')}"
    env = _cli("env", "--json")
    assert env.returncode == 0, env.stderr
    info = json.loads(env.stdout)
    assert info["torch"] == metadata.version("torch")
    assert info["triton"] == metadata.version("triton")
    assert info["gguf"] == metadata.version("gguf")
    import torch

    if torch.cuda.is_available():
        assert info["capability"] == "%d.%d" % torch.cuda.get_device_capability(0)
        assert info["gpu_uuid"] == f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    else:
        assert info["gpu"] == "no GPU" and info["capability"] is None and info["gpu_uuid"] is None
    table = _cli("env")
    assert table.returncode == 0 and re.search(r"^vllm\s+\S+", table.stdout, re.M)


def test_stdout_to_stderr_keeps_a_json_document_alone_on_stdout():
    """What `generate --json` / `loader check --json` wrap vLLM in: Python prints and writes straight to file
    descriptor 1 (how C++ libraries print) inside the block go to stderr; stdout keeps only what comes after."""
    code = ("import os, sys\nfrom glm5lab.cli import stdout_to_stderr\n"
            "with stdout_to_stderr():\n    print('python log')\n    os.write(1, b'native log\\n')\n"
            "with stdout_to_stderr(False):\n    pass\nprint('{\"ok\": true}')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"ok": True}
    assert "python log" in out.stderr and "native log" in out.stderr


def test_gpu_info_names_the_device_by_its_uuid(monkeypatch):
    """On a CUDA machine gpu_info gives the device's UUID as nvidia-smi writes it (GPU-...), so that a result's
    provenance tells one lent GPU of a kind from another; here torch.cuda is stood in for."""
    import uuid

    import torch

    from glm5lab.env import gpu_info

    dev_uuid = uuid.uuid4()
    props = type("Props", (), {"uuid": dev_uuid})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    assert gpu_info() == {"gpu": "NVIDIA H200", "capability": "9.0", "gpu_uuid": f"GPU-{dev_uuid}"}


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtxpro6000"), ("NVIDIA GeForce RTX 5090", "rtx5090"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GH200 480GB", "gh200"), ("no GPU", "cpu")])
def test_gpu_slug_names_the_model_not_its_memory_or_form(name, slug):
    """The word gpu_run.sh names per-GPU result files with (results/h100/, kernel_bench_h100_<tag>.csv): one word
    a model, the same for its memory sizes and form factors, never the H200's for an H100."""
    from glm5lab.env import gpu_slug

    assert gpu_slug(name) == slug


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes", "Y", "0", "false", "off", "2", "", "yes ", None])
def test_interpreter_mode_reads_triton_interpret_as_triton_does(monkeypatch, value):
    """glm5lab picks GPU-only paths (inline asm, maxnreg, the bf16 upcast) from interpreter_mode(): it must agree
    with Triton's own reading of TRITON_INTERPRET, or a kernel Triton interprets gets a GPU-only launch."""
    from triton._C.libtriton import getenv_bool

    from glm5lab.env import interpreter_mode

    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_mode() == getenv_bool("TRITON_INTERPRET", False)


def test_env_slug_cli_names_this_machine():
    from glm5lab.env import gpu_info, gpu_slug

    out = _cli("env", "--slug")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == gpu_slug(gpu_info()["gpu"]) and out.stdout.strip().isalnum()


def test_git_sha_marks_uncommitted_code_but_not_results(tmp_path, monkeypatch):
    """Rows made from uncommitted code used to name HEAD as if it had made them; a run's own result files
    (tracked under results/) must not mark it."""
    from glm5lab.env import git_sha

    monkeypatch.delenv("GLM5LAB_GIT_SHA", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (tmp_path / "glm5lab").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "glm5lab" / "k.py").write_text("x = 1\n")
    (tmp_path / "results" / "r.csv").write_text("a\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(git + args, check=True, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_sha(tmp_path) == head
    (tmp_path / "results" / "r.csv").write_text("a\n1\n")
    assert git_sha(tmp_path) == head
    (tmp_path / "glm5lab" / "k.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == head + "-dirty"
    assert _cli("env", "--sha").stdout.strip().split("-")[0] == git_sha().split("-")[0]


def test_unknown_subcommand_fails_cleanly():
    out = _cli("no-such-command")
    assert out.returncode != 0 and "Traceback" not in out.stderr


def _requirement_set(reqs) -> set[str]:
    return {re.sub(r"\s+", "", r).lower() for r in reqs}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in ("cpu", "notebooks", "test"):
        wanted |= set(project["optional-dependencies"][extra])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {p for p in pip_section if not p.startswith("-")}
    assert _requirement_set(listed) == _requirement_set(wanted)
    pins = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    assert pins, "environment.yml must pin the Python version"


def test_no_mismatched_torch_companions_installed():
    """PyPI's torchvision/torchaudio/torchcodec break vLLM's imports beside torch 2.13.0+cpu."""
    if not metadata.version("torch").endswith("+cpu"):
        pytest.skip("only the CPU torch build conflicts with PyPI's companion wheels")
    for name in ("torchvision", "torchaudio", "torchcodec"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version(name)


def test_vllm_registry_imports_and_mla_backends_load():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    loaded = {}
    for name in ("TRITON_MLA", "FLASHMLA", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"):
        cls = AttentionBackendEnum[name].get_class()
        loaded[name] = cls
        assert hasattr(cls, "is_sparse") and hasattr(cls, "validate_configuration")
    assert loaded["FLASHMLA_SPARSE"].is_sparse() and not loaded["TRITON_MLA"].is_sparse()


def _write_notebook(path: Path, body: str) -> None:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('profile = "gpu"\nresults_dir = "nowhere"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# trivial"), params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)


def test_runner_executes_notebooks_in_order_and_injects_parameters(tmp_path):
    books = tmp_path / "notebooks"
    books.mkdir()
    _write_notebook(books / "01_first.ipynb", "import os\nprint('profile', profile, os.environ.get('TRITON_INTERPRET'))")
    _write_notebook(books / "02_second.ipynb", "print(sum(range(10)))")
    (books / "notes.ipynb").write_text("not a numbered notebook, never run")
    results = tmp_path / "results"
    done = run_all("cpu", notebook_dir=books, results_dir=results, progress=False)
    assert [p.name for p in done] == ["01_first.ipynb", "02_second.ipynb"]
    first = nbformat.read(done[0], as_version=4)
    text = "".join(o.get("text", "") for c in first.cells if c.cell_type == "code" for o in c.outputs)
    assert "profile cpu 1" in text  # injected profile, interpreter mode for the cpu profile
    prov_path = results / "notebooks" / "cpu" / "provenance.json"
    prov = json.loads(prov_path.read_text())
    assert prov["profile"] == "cpu" and sorted(prov["notebooks"]) == ["01_first.ipynb", "02_second.ipynb"]
    assert prov["notebooks"]["01_first.ipynb"]["torch"] == metadata.version("torch")
    first_stamp = prov["notebooks"]["01_first.ipynb"]["timestamp"]
    # a run of one notebook keeps the other's entry
    run_all("cpu", notebook_dir=books, results_dir=results, only=["02"], progress=False)
    prov = json.loads(prov_path.read_text())
    assert sorted(prov["notebooks"]) == ["01_first.ipynb", "02_second.ipynb"]
    assert prov["notebooks"]["01_first.ipynb"]["timestamp"] == first_stamp


def test_runner_failure_names_notebook_and_cell_and_keeps_earlier_outputs(tmp_path):
    books = tmp_path / "notebooks"
    books.mkdir()
    _write_notebook(books / "01_ok.ipynb", "x = 1")
    _write_notebook(books / "02_bad.ipynb", "raise ValueError('boom from the notebook')")
    out = tmp_path / "results"
    good = out / "notebooks" / "cpu" / "02_bad.ipynb"
    good.parent.mkdir(parents=True)
    good.write_text("earlier good copy")
    with pytest.raises(Glm5labError) as err:
        run_all("cpu", notebook_dir=books, results_dir=out, progress=False)
    msg = str(err.value)
    assert "02_bad.ipynb" in msg and "boom from the notebook" in msg
    assert "cell 3 of the executed copy" in msg  # papermill's injected-parameters cell comes first
    assert "raise ValueError" in msg             # names the failing cell by its source
    assert good.read_text() == "earlier good copy"          # earlier output intact
    assert (out / "notebooks" / "cpu" / "01_ok.ipynb").exists()
    assert (out / "notebooks" / "cpu" / "02_bad.failed.ipynb").exists()
    assert not list((out / "notebooks" / "cpu").glob("*.partial.ipynb"))


def test_runner_names_a_notebook_whose_kernel_died_and_records_what_passed_before(tmp_path):
    """A kernel killed mid-notebook (out of memory, a crash) used to end the main job in nbclient's traceback with
    the executed copy deleted; provenance.json was written only when every notebook passed, so a rewritten
    01 sat beside the previous run's provenance."""
    books = tmp_path / "notebooks"
    books.mkdir()
    _write_notebook(books / "01_ok.ipynb", "print('first cell ran')")
    _write_notebook(books / "02_dies.ipynb", "import os\nos._exit(137)")
    out = tmp_path / "results"
    with pytest.raises(Glm5labError) as err:
        run_all("cpu", notebook_dir=books, results_dir=out, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "notebook 02_dies.ipynb failed: its kernel died" in msg
    nbs = out / "notebooks" / "cpu"
    assert (nbs / "02_dies.failed.ipynb").exists() and not list(nbs.glob("*.partial.ipynb"))
    prov = json.loads((nbs / "provenance.json").read_text())
    assert sorted(prov["notebooks"]) == ["01_ok.ipynb"]


def test_runner_leaves_each_csv_it_appended_to_with_its_own_run_and_archives_the_earlier_ones(tmp_path):
    """After a passing run, a benchmark CSV the notebooks appended to holds that run's rows only -- also where an
    earlier run had the same commit and command, as two `make reproduce` at one commit do -- and the earlier rows
    sit in <name>_history.csv.gz; a benchmark CSV the run did not touch, a CSV of another kind and a probe's CSV
    with a column of its own (which archiving refuses) stay as they were. A failing run archives nothing."""
    import gzip

    import pandas as pd

    from glm5lab.bench.records import COLUMNS, provenance

    results = tmp_path / "results"
    (results / "bench").mkdir(parents=True)
    row = {"suite": "s", "implementation": "glm5lab", "shape": "H8", "metric": "time", "unit": "us"}
    prov = provenance("notebook 05 (cpu profile)")  # this commit and command, as every earlier row
    earlier = pd.DataFrame([{**prov, **row, "value": v, "timestamp": ts} for v, ts in
                            ((1, "2026-01-01T00:00:00+00:00"), (2, "2026-01-02T00:00:00+00:00"), (3, ""))],
                           columns=COLUMNS)
    appended, untouched, other = results / "bench" / "k.csv", results / "bench" / "u.csv", results / "plain.csv"
    earlier.to_csv(appended, index=False)
    earlier.to_csv(untouched, index=False)
    other.write_text("a,b\n1,2\n")
    probe = results / "probe.csv"
    earlier.assign(call=0).to_csv(probe, index=False)
    before = {p: p.read_bytes() for p in (appended, untouched, other, probe)}
    books = tmp_path / "notebooks"
    books.mkdir()
    _write_notebook(books / "01_append.ipynb",
                    "from pathlib import Path\nfrom glm5lab.bench.records import append_rows\n"
                    f"append_rows(Path(results_dir) / 'bench' / 'k.csv', [{row!r} | {{'value': v}} for v in (7, 8)],"
                    f" command={prov['command']!r})\n"
                    "open(Path(results_dir) / 'plain.csv', 'a').write('3,4\\n')\n"
                    "open(Path(results_dir) / 'probe.csv', 'a').write(open(Path(results_dir) / 'probe.csv')"
                    ".read().splitlines()[1] + '\\n')")
    _write_notebook(books / "02_bad.ipynb", "raise ValueError('boom')")
    with pytest.raises(Glm5labError):
        run_all("cpu", notebook_dir=books, results_dir=results, progress=False)
    assert pd.read_csv(appended)["value"].tolist() == [1, 2, 3, 7, 8]   # a failed run moves nothing
    assert not list(results.rglob("*_history.csv.gz"))
    for p in (appended, other, probe):
        p.write_bytes(before[p])
    (books / "02_bad.ipynb").unlink()
    run_all("cpu", notebook_dir=books, results_dir=results, progress=False)
    assert pd.read_csv(appended)["value"].tolist() == [7, 8]
    assert pd.read_csv(results / "bench" / "k_history.csv.gz")["value"].tolist() == [1, 2, 3]
    assert list(pd.read_csv(appended).columns) == COLUMNS
    assert untouched.read_bytes() == before[untouched] and not (results / "bench" / "u_history.csv.gz").exists()
    assert other.read_text() == "a,b\n1,2\n3,4\n" and not (results / "plain_history.csv.gz").exists()
    assert len(pd.read_csv(probe)) == 4 and not (results / "probe_history.csv.gz").exists()
    run_all("cpu", notebook_dir=books, results_dir=results, progress=False)    # a second run: history grows
    assert pd.read_csv(appended)["value"].tolist() == [7, 8]
    assert pd.read_csv(results / "bench" / "k_history.csv.gz")["value"].tolist() == [1, 2, 3, 7, 8]
    assert gzip.decompress((results / "bench" / "k_history.csv.gz").read_bytes()).count(b"suite,") == 1


def test_runner_rejects_unknown_profile(tmp_path):
    with pytest.raises(Glm5labError, match="unknown profile"):
        run_all("tpu", notebook_dir=tmp_path, results_dir=tmp_path)


def test_runner_refuses_the_gpu_profile_without_a_device(tmp_path, monkeypatch):
    import glm5lab.notebooks

    monkeypatch.setattr(glm5lab.notebooks, "detect_profile", lambda: "cpu")   # what torch says on a CPU machine
    with pytest.raises(Glm5labError, match="profile 'gpu' needs a CUDA device"):
        run_all("gpu", notebook_dir=ROOT / "notebooks", results_dir=tmp_path / "results", progress=False)
    assert not (tmp_path / "results").exists()


def test_runner_refuses_a_folder_without_notebooks(tmp_path):
    """A wrong --notebooks used to 'pass' with nothing run (and rewrite provenance.json), or crash on its temp file."""
    results = tmp_path / "results"
    with pytest.raises(Glm5labError, match="no such notebook folder"):
        run_all("cpu", notebook_dir=tmp_path / "absent", results_dir=results, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Glm5labError, match=r"no numbered notebooks \(NN_name.ipynb\) in it"):
        run_all("cpu", notebook_dir=tmp_path / "empty", results_dir=results, progress=False)
    assert not results.exists()


def test_committed_notebooks_have_no_outputs():
    books = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for book in books:
        nb = nbformat.read(book, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{book.name} cell {i} has output"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{book.name} needs exactly one cell tagged 'parameters'"
        assert re.search(r'^profile\s*=\s*"cpu"', tagged[0].source, re.M), book.name


def test_package_scripts_and_tests_are_pyflakes_clean():
    """No undefined or unused names anywhere in the code: pyflakes over glm5lab/, scripts/ and tests/ reports
    nothing (a name it flags is a bug or a confusion to fix, not to silence)."""
    res = subprocess.run([sys.executable, "-m", "pyflakes", "glm5lab", "scripts", "tests"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_the_gpu_runs_test_part_covers_every_test_file_with_gpu_tests():
    """scripts/gpu_run.sh's `tests` part names its files (the device has no vLLM, so files that need it at import are
    left out): a new file of `gpu` tests left off that list would never run anywhere, CI deselecting it."""
    tests = Path(__file__).parent
    script = (tests.parent / "scripts" / "gpu_run.sh").read_text()
    listed = set(re.findall(r"tests/(test_\w+\.py)", script.split("gpu_tests=${GPU_TESTS:-", 1)[1].split("}", 1)[0]))
    gpu_mark = re.compile(r"^@pytest\.mark\.gpu\b|marks=pytest\.mark\.gpu\b", re.M)
    marked = {p.name for p in tests.glob("test_*.py") if gpu_mark.search(p.read_text())}
    assert marked, "no gpu tests found: the marker's spelling changed?"
    assert marked - listed == set(), f"gpu tests that gpu_run.sh's tests part never runs: {sorted(marked - listed)}"
    assert listed <= {p.name for p in tests.glob("test_*.py")}


def test_provenance_says_vllm_is_missing_and_names_the_cpu(monkeypatch):
    """GPU rows had an empty vllm cell (the lent GPUs have no vLLM), and CPU results named only "x86_64"."""
    from glm5lab import env
    from glm5lab.bench import records

    real = env.collect
    monkeypatch.setattr(records, "collect", lambda: {**real(), "vllm": None})
    assert records.provenance("x")["vllm"] == "not installed"
    info = real()
    assert info["cpu_count"] == __import__("os").cpu_count()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "model name" in cpuinfo.read_text():
        assert info["cpu_model"] and info["cpu_model"] != info["cpu"]


def test_a_failing_measured_test_says_it_reads_committed_results(tmp_path):
    """A `measured` test (a rule held against committed GPU rows) that fails tells the reader a results-only commit
    can be the cause; an unmarked failure does not get that hint."""
    (tmp_path / "test_rule.py").write_text(
        "import pytest\n\n@pytest.mark.measured\ndef test_rule():\n    assert 1 == 2\n\n"
        "def test_plain():\n    assert 1 == 2\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(tmp_path / "test_rule.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "2 failed" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("refit the rule") == 1 and "- measured -" in run.stdout, run.stdout


def test_readme_first_screen_gives_the_two_commands_ci_and_make_run():
    """The README's first code block holds the two commands that matter on a fresh machine; `.ci/run` runs the test
    one, and the Makefile turns them into the notebook runner and pytest over tests/."""
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first_block and readme.index("```bash") < 1500, "the commands must be on the README's first screen"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make reproduce", "make test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in ci
    make = (ROOT / "Makefile").read_text()
    recipe = {name: body for name, body in re.findall(r"^([a-z-]+):[^\n]*\n((?:\t[^\n]*\n)+)", make, re.M)}
    assert "glm5lab notebooks run" in recipe["reproduce"] and "pytest" in recipe["test"]
    assert re.search(r"-m pytest .*\btests\b", recipe["test"])


def test_only_the_vllm_plugin_wing_imports_vllm():
    """vLLM stays at the edge: every module outside glm5lab.vllm_plugin (GGUF tools, sparse code, kernels,
    references, benchmarks, CLI) imports without importing vLLM, so the kernels serve any engine and a vLLM upgrade
    touches one folder. Checked in a fresh interpreter, module by module."""
    code = """
import importlib, pkgutil, sys
import glm5lab
names = sorted(m.name for m in pkgutil.walk_packages(glm5lab.__path__, "glm5lab.")
               if not m.name.startswith("glm5lab.vllm_plugin") and not m.name.endswith("__main__"))
for name in names:
    importlib.import_module(name)
    if any(k == "vllm" or k.startswith(("vllm.", "vllm_gguf_plugin")) for k in sys.modules):
        print("IMPORTS-VLLM", name)
        break
else:
    print("OK", len(names))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("OK") and int(last.split()[1]) > 40, out.stdout[-2000:]
