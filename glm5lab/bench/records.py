"""Long-format benchmark rows (one measurement per row) appended to a CSV, each with its provenance.

Columns: suite, implementation, shape, dtype, layout, metric, value, unit, p20, p50, p80, then the
provenance columns (GPU, capability, torch/triton/vLLM versions, git SHA, timestamp). Plots are drawn
from these files, never the other way round.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Iterable

from glm5lab.env import collect

MEASUREMENT_COLUMNS = ["suite", "implementation", "shape", "dtype", "layout", "metric", "value", "unit",
                       "p20", "p50", "p80"]
PROVENANCE_COLUMNS = ["gpu", "capability", "torch", "triton", "vllm", "glm5lab", "git_sha",
                      "triton_interpret", "timestamp", "command"]
COLUMNS = MEASUREMENT_COLUMNS + PROVENANCE_COLUMNS


def provenance(command: str = "") -> dict:
    info = collect()
    row = {k: info.get(k) for k in PROVENANCE_COLUMNS if k != "command"}
    row["command"] = command
    return row


def append_rows(path: str | os.PathLike, rows: Iterable[dict], command: str = "") -> int:
    """Append rows (dicts with MEASUREMENT_COLUMNS keys) to `path`, adding provenance; returns the count.
    Unknown keys are an error, missing measurement keys are left empty."""
    rows = list(rows)
    if not rows:
        return 0
    prov = provenance(command)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            extra = set(row) - set(COLUMNS)
            if extra:
                raise ValueError(f"unknown benchmark columns {sorted(extra)}")
            writer.writerow({**prov, **row})
    return len(rows)


def read(path: str | os.PathLike):
    """The CSV as a pandas DataFrame."""
    import pandas as pd

    return pd.read_csv(path)
