"""Output files written whole: a temporary name beside the target, renamed over it only on success.

`tempfile.mkstemp` makes its file readable by its owner alone (0600). A merged GGUF, a generated config.json or
a result CSV is read by other users and processes (a vLLM server under its own account, a colleague), so the
temporary file takes the mode an ordinary `open()` would have given it (0666 less the umask) before the rename.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from glm5lab.errors import Glm5labError


def usual_mode() -> int:
    """The mode `open(path, "w")` gives a new file under the current umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def require_file_target(path: Path) -> None:
    """An output path must name a file: an existing folder there would only fail at the rename, after the work."""
    if Path(path).is_dir():
        raise Glm5labError(f"{path}: is a folder; give the output file's name")


def require_not_an_input(target: Path | str, inputs, what: str) -> None:
    """Refuse an output that is one of the files the command reads: it would be replaced by what it produced."""
    target = Path(target)
    if not target.exists():
        return
    for src in inputs:
        if Path(src).exists() and os.path.samefile(target, src):
            raise Glm5labError(f"{target}: is {what} this command reads; give another output name")


def require_folder_target(path: Path | str, what: str = "results folder") -> Path:
    """A folder outputs go under: refused at once when a file stands there (mkdir would fail after the work)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise Glm5labError(f"{path}: is a file; the {what} must be a folder")
    return path


def make_folder(path: Path | str) -> Path:
    """`mkdir -p` for an output folder, refused in one line when it cannot be made (a file in the way, a read-only
    or missing mount) instead of an OSError from deep inside the writer."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (path, *path.parents) if _is_file(p)), None)
        if blocker is not None:   # mkdir says "File exists" or "Not a directory": name the file in the way
            inside = "" if blocker == path else f" {path}"
            raise Glm5labError(f"{blocker}: cannot make the output folder{inside} (a file is in the way)") from None
        raise Glm5labError(f"{path}: cannot make the output folder ({exc.strerror or exc})") from None
    return path


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:     # (an unreadable folder above it: not a file in the way)
        return False


def cannot_write_there(folder: Path, exc: OSError) -> Glm5labError:
    return Glm5labError(f"{folder}: cannot write there ({exc.strerror or exc})")


def temp_beside(path: Path | str) -> tuple[int, Path]:
    """(descriptor, path) of a new temporary file in `path`'s folder (created if needed), with the usual mode.
    Its name is unique (two writers of one target never share it) and ends in `.tmp` plus the target's suffix,
    so writers that pick a format by suffix (matplotlib, pandas' compression) pick the target's."""
    path = Path(path)
    require_file_target(path)
    make_folder(path.parent)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    except OSError as exc:
        raise cannot_write_there(path.parent, exc) from None
    os.fchmod(fd, usual_mode())
    return fd, Path(name)


@contextmanager
def replacing(path: Path | str) -> Iterator[Path]:
    """Write `path` whole: yields a temporary path beside it (see temp_beside) for the caller to write, renames it
    over `path` when the block ends without an error and removes it otherwise, so `path` is never half-written."""
    path = Path(path)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_figure(fig, path: Path | str, dpi: int = 110, **savefig_kwargs) -> Path:
    """A matplotlib figure written whole (see `replacing`): the format follows the target's suffix, and a folder
    that cannot be made or written is one line, never matplotlib's OSError after the plotting."""
    path = Path(path)
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=dpi, **savefig_kwargs)
    return path


def write_table(df, path: Path | str, **to_csv_kwargs) -> Path:
    """A pandas table written whole as CSV (see `replacing`), without its index: a reader, or a run stopped halfway,
    never leaves half a table. The compression follows the target's suffix (`.csv.gz` is gzip)."""
    path = Path(path)
    with replacing(path) as tmp:
        df.to_csv(tmp, index=False, **to_csv_kwargs)
    return path


def _json_value(value):
    """A numpy or torch scalar as its Python number; anything else JSON has no type for (paths, timestamps) as str."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return str(value)


def write_json(obj, path: Path | str, indent: int = 1) -> Path:
    """`obj` written whole as JSON (see `replacing`): numpy / torch scalars as numbers, other values JSON has no type
    for (paths, timestamps) as their str()."""
    path = Path(path)
    text = json.dumps(obj, indent=indent, default=_json_value) + "\n"   # before the file: a failure leaves it as it was
    with replacing(path) as tmp:
        tmp.write_text(text)
    return path
