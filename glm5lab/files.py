"""Output files written whole: a temporary name beside the target, renamed over it only on success.

`tempfile.mkstemp` makes its file readable by its owner alone (0600). A merged GGUF, a generated config.json or
a result CSV is read by other users and processes (a vLLM server under its own account, a colleague), so the
temporary file takes the mode an ordinary `open()` would have given it (0666 less the umask) before the rename.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

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


def temp_beside(path: Path | str) -> tuple[int, Path]:
    """(descriptor, path) of a new temporary file in `path`'s folder (created if needed), with the usual mode."""
    path = Path(path)
    require_file_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, usual_mode())
    return fd, Path(name)
