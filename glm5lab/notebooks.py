"""Run the notebooks headless with papermill: the project's main job (`glm5lab notebooks run`).

Profile `cpu` (no CUDA device): small parameters, Triton in its interpreter (TRITON_INTERPRET=1).
Profile `gpu`: full sizes on the device. Each notebook is executed into
results/notebooks/<profile>/<name>.ipynb; a failed one goes to <name>.failed.ipynb and stops the run
with the notebook's name and failing cell, leaving the good copies of earlier runs intact. After a run
in which every notebook passed, each benchmark CSV the run appended to keeps that run's rows alone; earlier
runs' rows move to <name>_history.csv.gz beside it (readers take the latest run; the CSVs otherwise grow
~0.3 MB a CPU run, and the tree a GPU call carries is capped).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from glm5lab.bench import records
from glm5lab.errors import Glm5labError
from glm5lab.files import make_folder, require_folder_target, write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("cpu", "gpu")


def detect_profile() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "gpu" if torch.cuda.is_available() else "cpu"


def find_notebooks(notebook_dir: Path, only: list[str] | None = None) -> list[Path]:
    """Numbered notebooks (NN_name.ipynb) in order; `only` filters by prefix or name substring."""
    if not notebook_dir.is_dir():
        raise Glm5labError(f"{notebook_dir}: no such notebook folder")
    books = sorted(p for p in notebook_dir.glob("[0-9][0-9]*.ipynb") if p.is_file())
    if not books:
        raise Glm5labError(f"{notebook_dir}: no numbered notebooks (NN_name.ipynb) in it")
    if only:
        books = [p for p in books if any(p.name.startswith(o) or o in p.stem for o in only)]
        if not books:
            raise Glm5labError(f"no notebook in {notebook_dir} matches {only}")
    return books


def run_notebook(src: Path, out_dir: Path, parameters: dict, *, kernel_name: str | None = None,
                 progress: bool = True) -> Path:
    """Execute one notebook; returns the executed copy. Raises Glm5labError naming the failing cell."""
    import papermill as pm

    make_folder(out_dir)
    final = out_dir / src.name
    failed = out_dir / (src.stem + ".failed.ipynb")
    partial = out_dir / (src.stem + ".partial.ipynb")
    try:
        pm.execute_notebook(str(src), str(partial), parameters=parameters, cwd=str(src.parent),
                            kernel_name=kernel_name or "python3", language="python", progress_bar=progress,
                            log_output=False)
    except pm.PapermillExecutionError as exc:
        partial.replace(failed)
        first_line = next((ln for ln in (exc.source or "").splitlines() if ln.strip()), "")
        raise Glm5labError(
            f"notebook {src.name} failed in cell {exc.cell_index} of the executed copy "
            f"(execution count {exc.exec_count}, source {first_line[:80]!r}): "
            f"{exc.ename}: {exc.evalue.splitlines()[0] if exc.evalue else ''} "
            f"-- executed copy with the error: {failed}") from None
    except Exception as exc:
        # the kernel died (out of memory, a crash) or a cell ran past its time: keep what ran, name the notebook
        from nbclient.exceptions import CellTimeoutError, DeadKernelError

        if not isinstance(exc, (CellTimeoutError, DeadKernelError)) or not partial.exists():
            partial.unlink(missing_ok=True)
            raise
        partial.replace(failed)
        what = "its kernel died" if isinstance(exc, DeadKernelError) else "a cell ran past its time limit"
        raise Glm5labError(f"notebook {src.name} failed: {what} ({type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}) -- executed copy "
                           f"up to there: {failed}") from None
    partial.replace(final)
    failed.unlink(missing_ok=True)
    return final


def run_all(profile: str | None = None, *, notebook_dir: Path | None = None,
            results_dir: Path | None = None, only: list[str] | None = None,
            progress: bool = True) -> list[Path]:
    """The main job: every notebook in order under one profile, with provenance written beside them."""
    profile = profile or detect_profile()
    if profile not in PROFILES:
        raise Glm5labError(f"unknown profile {profile!r}; expected one of {PROFILES}")
    if profile == "gpu" and detect_profile() != "gpu":
        # the notebooks' gpu cells launch CUDA kernels; without a device they fail deep in Triton's driver lookup
        raise Glm5labError("profile 'gpu' needs a CUDA device and torch sees none; run --profile cpu (the default "
                           "here)")
    notebook_dir = Path(notebook_dir or REPO_ROOT / "notebooks").resolve()
    results_dir = require_folder_target(Path(results_dir or REPO_ROOT / "results").resolve())
    out_dir = results_dir / "notebooks" / profile
    if profile == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the notebook kernels
    books = find_notebooks(notebook_dir, only)
    rows_before = records.row_counts(results_dir)
    done: list[Path] = []
    for i, book in enumerate(books, 1):
        print(f"[{i}/{len(books)}] {book.name} (profile {profile})", file=sys.stderr, flush=True)
        t0 = time.time()
        params = {"profile": profile, "results_dir": str(results_dir)}
        done.append(run_notebook(book, out_dir, params, progress=progress))
        # at once: an executed copy must never sit beside another run's provenance, even if a later notebook fails
        record_provenance(out_dir / "provenance.json", profile, done[-1:])
        print(f"[{i}/{len(books)}] {book.name} done in {time.time() - t0:.0f} s", file=sys.stderr)
    archive_earlier_runs(results_dir, rows_before)
    return done


def archive_earlier_runs(results_dir: Path, rows_before: dict[Path, tuple[int, str]]) -> None:
    """Each benchmark CSV under `results_dir` that grew since `rows_before` (records.row_counts at the run's start)
    keeps the rows it gained; the ones it held go to its `<name>_history.csv.gz` (records.archive_appended)."""
    for csv, moved in records.archive_appended(results_dir, rows_before).items():
        print(f"[archive] {csv.relative_to(results_dir)}: {moved} rows of earlier runs -> "
              f"{records.history_path(csv).name}", file=sys.stderr)


def record_provenance(path: Path, profile: str, executed: list[Path]) -> dict:
    """provenance.json beside the executed notebooks: for each notebook, the machine, versions, git SHA and
    command of the run that last executed it (a run of some notebooks keeps the others' entries)."""
    from glm5lab.env import collect

    try:
        book = json.loads(path.read_text())
        if not isinstance(book.get("notebooks"), dict):
            book = {}
    except (OSError, ValueError):
        book = {}
    run = collect()
    run.update(profile=profile, command=" ".join(["glm5lab"] + sys.argv[1:]))
    notebooks = book.get("notebooks", {})
    notebooks.update({p.name: run for p in executed})
    book = {"profile": profile, "notebooks": dict(sorted(notebooks.items()))}
    write_json(book, path, indent=2)
    return book


def _run(args) -> int:
    run_all(args.profile, notebook_dir=args.notebooks, results_dir=args.results, only=args.only,
            progress=not args.no_progress)
    return 0


def add_command(sub) -> None:
    p = sub.add_parser("notebooks", help="run the notebooks headless (the main job)")
    nsub = p.add_subparsers(dest="notebooks_command", metavar="ACTION", required=True)
    r = nsub.add_parser("run", help="execute notebooks/NN_*.ipynb into results/notebooks/<profile>/")
    r.add_argument("--profile", choices=PROFILES, default=None,
                   help="cpu (small shapes, Triton interpreter) or gpu; default: detected")
    r.add_argument("--only", nargs="+", help="run only notebooks whose name starts with / contains these")
    r.add_argument("--notebooks", type=Path, default=None, help="notebook folder (default: notebooks/)")
    r.add_argument("--results", type=Path, default=None, help="results folder (default: results/)")
    r.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    r.set_defaults(func=_run)
