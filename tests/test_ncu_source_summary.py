"""scripts/ncu_source_summary.py on a real ncu source page (results/kernels/logs_v35, the 16-head kernel's gathers
alone at 512 tokens): its loops, their share of the stall samples, and a clear error for a file that is not one."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "results/kernels/logs_v35/run1_ncu_source_ws8x2sod3_H16_T512.csv.gz"


def _summary_module():
    spec = importlib.util.spec_from_file_location("ncu_source_summary", ROOT / "scripts/ncu_source_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_finds_the_loader_loop_and_accounts_for_every_sample():
    mod = _summary_module()
    df = mod.load(str(PAGE))
    assert len(df) > 1000 and df["samples"].sum() > 10000
    table = mod.summarize(df)
    assert table["samples %"].sum() == pytest.approx(100.0, abs=0.5)      # each instruction in one row only
    loader = table[table["holds"].str.contains("LDGSTS") & (table["instructions"] < 500)]
    assert len(loader) == 1                                               # the gathers' step loop, ~380 instructions
    assert loader["samples %"].iloc[0] > 20 and loader["top stalls %"].iloc[0].startswith("long_sb")
    assert all(first < last for first, last in mod.loops(df))


def test_summary_refuses_a_file_that_is_not_a_source_page(tmp_path):
    mod = _summary_module()
    bad = tmp_path / "not_ncu.csv"
    bad.write_text('"a","b"\n1,2\n')
    with pytest.raises(SystemExit, match="is not ncu's SASS source page"):
        mod.load(str(bad))
    with pytest.raises(SystemExit, match="cannot read"):
        mod.load(str(tmp_path / "missing.csv.gz"))
