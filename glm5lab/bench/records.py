"""Long-format benchmark rows (one measurement per row) appended to a CSV, each with its provenance.

Columns: suite, implementation, shape, dtype, layout, metric, value, unit, p20, p50, p80, then the
provenance columns (GPU, capability, the board's UUID, torch/triton/vLLM versions, git SHA, timestamp). Plots
are drawn from these files, never the other way round. A file written before a provenance column existed is
rewritten with the current header (the new column empty in its old rows) when rows are next appended to it.
"""
from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Iterable

from glm5lab.env import collect
from glm5lab.files import make_folder, replacing, write_json, write_table

MEASUREMENT_COLUMNS = ["suite", "implementation", "shape", "dtype", "layout", "metric", "value", "unit",
                       "p20", "p50", "p80"]
PROVENANCE_COLUMNS = ["gpu", "capability", "gpu_uuid", "torch", "triton", "vllm", "glm5lab", "git_sha",
                      "triton_interpret", "timestamp", "command"]
COLUMNS = MEASUREMENT_COLUMNS + PROVENANCE_COLUMNS


def command_line(module: str, argv=None) -> str:
    """How a `python -m <module>` tool was run (`argv` as its main() got it; None: this process's arguments), quoted
    so that it can be pasted back: the `command` of the rows it writes."""
    import shlex

    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def provenance(command: str = "") -> dict:
    info = collect()
    row = {k: info.get(k) for k in PROVENANCE_COLUMNS if k != "command"}
    if row.get("vllm") is None:   # the lent GPUs have none: say so rather than leave the cell empty
        row["vllm"] = "not installed"
    row["command"] = command
    return row


def append_rows(path: str | os.PathLike, rows: Iterable[dict], command: str = "") -> int:
    """Append rows (dicts with MEASUREMENT_COLUMNS keys) to `path`, adding provenance; returns the count.
    Unknown keys are an error, missing measurement keys are left empty."""
    rows = list(rows)
    if not rows:
        return 0
    extra = set().union(*rows) - set(COLUMNS)
    if extra:   # before the file is touched: a half-appended run would read as a whole one
        raise ValueError(f"unknown benchmark columns {sorted(extra)}")
    prov = provenance(command)
    path = Path(path)
    make_folder(path.parent)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        _conform_header(path)
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**prov, **row})
    return len(rows)


def _header(path: Path) -> list[str]:
    """The first row of a CSV, gzipped (a history) or not."""
    import gzip

    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", newline="") as fh:
        return next(csv.reader(fh), [])


def _conformable(columns) -> bool:
    """A benchmark CSV's columns: every measurement column, and provenance columns of this or an older header."""
    return set(MEASUREMENT_COLUMNS) <= set(columns) <= set(COLUMNS)


def _conform(df, path):
    """`df` (read as text) with exactly COLUMNS, in order; an older file's missing provenance columns empty."""
    if not _conformable(df.columns):
        raise ValueError(f"{path} is not a benchmark CSV (columns {list(df.columns)[:5]}...; expected {COLUMNS})")
    return df.reindex(columns=COLUMNS, fill_value="")


def _conform_header(path: Path) -> None:
    """Rewrite a CSV of an older header with COLUMNS (atomically), so appended rows line up with it."""
    if _header(path) == COLUMNS:
        return
    import pandas as pd

    df = _conform(pd.read_csv(path, dtype=str, keep_default_na=False), path)
    write_table(df, path, lineterminator="\r\n")       # (as csv.writer)


# provenance columns that are text even when they look like numbers: a git SHA such as 7e8792557537 parses as a
# float (inf) otherwise, in kernel_plots.last_run's provenance and the plots' captions
TEXT_COLUMNS = ("gpu", "gpu_uuid", "torch", "triton", "vllm", "glm5lab", "git_sha", "timestamp", "command")


def read(path: str | os.PathLike):
    """The CSV as a pandas DataFrame, its provenance's text columns (TEXT_COLUMNS) as text; a benchmark CSV written
    before a provenance column existed gets that column, empty."""
    import pandas as pd

    try:
        df = pd.read_csv(path, dtype=dict.fromkeys(TEXT_COLUMNS, str))
    except pd.errors.EmptyDataError:   # an empty file: no rows, no columns (callers say "holds no benchmark run")
        return pd.DataFrame()
    if set(MEASUREMENT_COLUMNS) <= set(df.columns):
        for col in PROVENANCE_COLUMNS:
            if col not in df.columns:
                df[col] = pd.Series(pd.NA, index=df.index, dtype=object)
    return df


def with_provenance_of(summary, rows, source: str):
    """A table derived from one run's rows (kernel_bench's `--summary`), given that run's provenance: the PROVENANCE
    columns of `rows`' last row, and `summarizes` naming the file the rows are in. Such tables are read alone."""
    last = rows.iloc[-1] if len(rows) else {}
    prov = {c: last.get(c) for c in PROVENANCE_COLUMNS}
    return summary.assign(**prov, summarizes=source)


def write_summary(summary, rows_csv: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Write `summary` (a table of the run just appended to `rows_csv`) whole to `path`, with that run's provenance."""
    df = read(rows_csv)
    return write_table(with_provenance_of(summary, df, Path(rows_csv).name), path)


def history_path(path: str | os.PathLike) -> Path:
    """Where `archive_older_runs` keeps a CSV's older runs: `<name>_history.csv.gz` beside it."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".csv") + "_history.csv.gz")


def archive_older_runs(path: str | os.PathLike, keep: int = 1) -> int:
    """Move every run but the last `keep` of an appended CSV into `<name>_history.csv.gz` beside it (gzip members
    appended, one header) and return how many rows moved. A run is the rows of one (git_sha, command) in file order.
    Why: the suite and notebook CSVs grow ~0.8 MB a GPU run and the tree a device call carries is capped (64 MiB);
    readers take the latest run anyway (`suites.latest_run`, the plots' last value). Both files are replaced
    atomically: an interrupted call leaves the old ones. keep=0 moves them all."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0 (the last runs to keep), got {keep}")
    df = _read_for_archive(path)
    run = df["git_sha"] + "\x00" + df["command"]
    runs = list(dict.fromkeys(run))
    return _move_to_history(Path(path), df, run.isin(runs[:-keep] if keep > 0 else runs))


def _read_for_archive(path):
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no benchmark CSV at {path}")
    return _conform(pd.read_csv(path, dtype=str, keep_default_na=False), path)


def _move_to_history(path: Path, df, moving_mask) -> int:
    import gzip

    import pandas as pd

    old = df[moving_mask]
    if old.empty:
        return 0
    history = history_path(path)
    # the history's one header must be COLUMNS too: one written before a provenance column existed is rewritten
    earlier = history.exists() and _header(history) == COLUMNS
    # both or neither; the history (inner block) is renamed first, so a crash between the renames leaves rows in
    # both files, never in neither
    with replacing(path) as tmp_csv, replacing(history) as tmp_hist:
        with open(tmp_hist, "wb") as fh:
            moving = old
            if earlier:
                fh.write(history.read_bytes())
            elif history.exists():
                moving = pd.concat([_conform(pd.read_csv(history, dtype=str, keep_default_na=False), history), old])
            with gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz:
                gz.write(moving.to_csv(index=False, header=not earlier, lineterminator="\r\n").encode())
        df[~moving_mask].to_csv(tmp_csv, index=False, lineterminator="\r\n")  # (as csv.writer)
    return len(old)


def _row_mark(header, row) -> str:
    """A short digest of one row's values under COLUMNS: tells whether a CSV still holds, at the same place, the row
    it held when it was counted (an append keeps it; an archiving in between does not)."""
    import hashlib

    values = dict(zip(header, row))
    return hashlib.sha1("\x1f".join(values.get(c, "") for c in COLUMNS).encode()).hexdigest()[:16]


def _count_to_last(rows) -> tuple[int, list[str]]:
    """How many non-empty rows a csv.reader (past its header) holds, and the last of them ([] when none)."""
    n, last = 0, []
    for row in rows:
        if row:
            n, last = n + 1, row
    return n, last


def row_counts(root: str | os.PathLike) -> dict[Path, tuple[int, str]]:
    """Every benchmark CSV under `root` that archiving accepts (not a probe's CSV with columns of its own), by path:
    its rows and the mark of its last row (`_row_mark`), i.e. what a run may append to and where it began."""
    counts = {}
    for p in sorted(Path(root).rglob("*.csv")):
        try:
            with open(p, newline="") as fh:
                rows = csv.reader(fh)
                header = next(rows, [])
                if _conformable(header):
                    n, last = _count_to_last(rows)
                    counts[p] = (n, _row_mark(header, last))
        except (UnicodeDecodeError, csv.Error, OSError):   # not a text CSV (or unreadable): not a benchmark CSV
            continue
    return counts


def archive_appended(root: str | os.PathLike, rows_before: dict[Path, tuple[int, str]]) -> dict[Path, int]:
    """Each benchmark CSV under `root` that was appended to since `rows_before` (`row_counts` taken before a run)
    keeps the rows it gained; the rows it held move to its history: it then holds that run alone, even where an
    earlier run had the same commit and command. Returns the rows moved, by path. A CSV the run created, left as it
    was, or rewrote (the row at its old end is another: archived already, by the main job inside a GPU call) is not
    touched."""
    moved = {}
    for path, (rows, _) in row_counts(root).items():
        held, mark = rows_before.get(path, (0, ""))
        if 0 < held < rows:
            df = _read_for_archive(path)
            if _row_mark(COLUMNS, df.iloc[held - 1].tolist()) == mark:
                moved[path] = _move_to_history(path, df, df.index < held)   # (RangeIndex: row numbers)
    return moved


def latest_gpu(path: str | os.PathLike) -> str:
    """The GPU named by the last row of a benchmark CSV ('' when it has no rows)."""
    with open(path, newline="") as fh:
        rows = csv.reader(fh)
        header = next(rows, [])
        last = _count_to_last(rows)[1]
    return dict(zip(header, last)).get("gpu", "")


def same_gpu(path: str | os.PathLike) -> tuple[bool, str]:
    """Whether this machine's GPU is the one that made the latest rows of `path`, and a line saying so. A GPU call
    that seeds the committed results appends to them: rows of another GPU model would read as the committed GPU's
    latest run (a call for an H200 may be given an H100)."""
    from glm5lab.env import gpu_info

    here = gpu_info()["gpu"]
    if not Path(path).exists():
        return True, f"no {path} to compare with; this machine: {here}"
    there = latest_gpu(path)
    same = there in ("", here)
    return same, (f"{path}: latest rows from {there or 'no GPU named'}; this machine has {here}: "
                  f"{'the same model' if same else 'another model'}")


def seed_tree(results: str | os.PathLike) -> tuple[Path | None, str]:
    """The committed results tree a GPU call on this machine should start from, and a line saying why: `results`
    when its suite CSV (bench/gpu/kernels.csv) is this GPU model's or absent, else the first `results/<name>/` whose
    suite CSV is this model's (results/h100/ on an H100), else None (start from an empty tree). So a call seeded on
    another model reads, and appends to, that model's own earlier runs (notebook 06 on an H100: the H100's suite)."""
    results = Path(results)
    suite_csv = Path("bench", "gpu", "kernels.csv")
    ok, line = same_gpu(results / suite_csv)
    if ok:
        return results, line
    for tree in sorted(d for d in results.iterdir() if (d / suite_csv).is_file()):
        if same_gpu(tree / suite_csv)[0]:
            return tree, f"{line}; {tree / suite_csv} is this model's"
    return None, f"{line}; no results/<gpu>/ tree holds this model's runs"


def main(argv=None) -> int:
    """`python -m glm5lab.bench.records archive CSV... [--keep N]`: `archive_older_runs` on each file.
    `... count ROOT --out JSON` before a run and `... archive-appended ROOT --since JSON` after it: `row_counts` and
    `archive_appended`, as the main job does (how `scripts/gpu_run.sh` keeps one run in each CSV it appended to).
    `... same-gpu CSV`: `same_gpu`, exit status 0 or 1. `... seed-tree RESULTS`: `seed_tree`'s folder on stdout (its
    line on stderr), exit status 1 when there is none (how gpu_run.sh picks the committed results to start from)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.records")
    sub = ap.add_subparsers(dest="action", required=True)
    arc = sub.add_parser("archive", help="move every run but the last --keep of each CSV to its history")
    arc.add_argument("csv", nargs="+", type=Path)
    arc.add_argument("--keep", type=int, default=1,
                     help="the last runs to keep in the CSV (default 1; 0 moves every run)")
    cnt = sub.add_parser("count", help="write the rows of every benchmark CSV under ROOT to a JSON file")
    cnt.add_argument("root", type=Path)
    cnt.add_argument("--out", type=Path, required=True)
    app = sub.add_parser("archive-appended", help="in each CSV under ROOT that grew since --since, move the rows "
                                                  "it held to its history")
    app.add_argument("root", type=Path)
    app.add_argument("--since", type=Path, required=True, help="the JSON file `count` wrote before the run")
    same = sub.add_parser("same-gpu", help="exit 0 when this machine's GPU made the latest rows of CSV, else 1")
    same.add_argument("csv", type=Path)
    seed = sub.add_parser("seed-tree", help="print the committed results tree of this machine's GPU model "
                                            "(RESULTS or RESULTS/<name>/); exit 1 when there is none")
    seed.add_argument("root", type=Path, metavar="results")
    args = ap.parse_args(argv)
    if args.action == "same-gpu":
        ok, line = same_gpu(args.csv)
        print(line)
        return 0 if ok else 1
    try:
        if args.action != "archive" and not args.root.is_dir():
            raise FileNotFoundError(f"no results folder at {args.root}")
        if args.action == "seed-tree":
            tree, line = seed_tree(args.root)
            print(line, file=sys.stderr)
            if tree is None:
                return 1
            print(tree)
        elif args.action == "count":
            counts = {str(p.relative_to(args.root)): list(c) for p, c in row_counts(args.root).items()}
            write_json(counts, args.out)
            print(f"{args.out}: rows of {len(counts)} benchmark CSVs under {args.root}")
        elif args.action == "archive-appended":
            try:
                before = {args.root / k: (int(n), str(m)) for k, (n, m) in json.loads(args.since.read_text()).items()}
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                raise ValueError(f"{args.since} is not a row count file written by `count` ({exc})") from None
            for p, moved in archive_appended(args.root, before).items():
                print(f"{p}: {moved} rows of earlier runs -> {history_path(p).name}")
        else:
            for p in args.csv:
                print(f"{p}: {archive_older_runs(p, args.keep)} rows of older runs -> {history_path(p).name}")
    except (FileNotFoundError, ValueError) as exc:      # (missing file, not a benchmark CSV: one line)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
