"""Where one kernel's warp stall samples fall, from ncu's SASS source page as CSV (scripts/ncu_profile.sh with
NCU_SOURCE=1): each loop (a backward branch's body, innermost first) with its share of the samples, the instructions
it executed, what it holds (HGMMA: a consumer's products; LDGSTS: the loader's gathers) and its top stall reasons;
then the instructions with the most samples.

    python scripts/ncu_source_summary.py results/kernels/logs_v35/run1_ncu_source_ws8x2sok_H16_T512.csv.gz
"""
import argparse
import gzip
import re
from io import StringIO

import pandas as pd

BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def stall_columns(df: pd.DataFrame) -> list[str]:
    """The page's stall-reason columns (all samples, not the not-issued copies)."""
    return [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]


def load(path: str) -> pd.DataFrame:
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"error: cannot read {path}: {exc}") from None
    head = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if head is None:
        raise SystemExit(f"error: {path} is not ncu's SASS source page as CSV (no \"Address\" header line; made by "
                         "`ncu -i REPORT --page source --print-source sass --csv`)")
    df = pd.read_csv(StringIO("\n".join(lines[head:])), dtype=str)
    df["addr"] = df["Address"].map(lambda a: int(a, 16))
    df["offset"] = df["addr"] - df["addr"].min()
    for col in ["Warp Stall Sampling (All Samples)", "Instructions Executed"] + stall_columns(df):
        df[col] = pd.to_numeric(df[col].str.replace(",", ""), errors="coerce").fillna(0)
    df["samples"] = df["Warp Stall Sampling (All Samples)"]
    df["source"] = df["Source"].str.strip()
    return df


def loops(df: pd.DataFrame) -> list[tuple[int, int]]:
    """(first, last) offsets of each backward branch's body."""
    found = []
    base = df["addr"].min()
    for off, src in zip(df["offset"], df["source"]):
        m = BRANCH.search(src)
        if m:
            target = int(m.group(1), 16)
            target = target - base if target >= base else target   # (ncu prints absolute or relative targets)
            if target < off:
                found.append((target, off))
    return sorted(set(found), key=lambda r: r[1] - r[0])


def summarize(df: pd.DataFrame, top: int = 4) -> pd.DataFrame:
    stall_cols = stall_columns(df)
    total = df["samples"].sum()
    rows, claimed = [], pd.Series(False, index=df.index)
    for first, last in loops(df):      # innermost (shortest) first; an outer loop keeps only what is not inner
        body = df["offset"].between(first, last)
        own = body & ~claimed
        part = df[own]
        if part["samples"].sum() == 0:
            claimed |= body
            continue
        stalls = part[stall_cols].sum().sort_values(ascending=False)
        src = " ".join(df[body]["source"])
        rows.append({"loop": f"{first:#x}-{last:#x}", "instructions": int(body.sum()),
                     "holds": "+".join(k for k in ("HGMMA", "LDGSTS", "SYNCS") if k in src) or "-",
                     "samples %": round(100 * part["samples"].sum() / total, 1),
                     "executed (M)": round(part["Instructions Executed"].sum() / 1e6, 2),
                     "top stalls %": ", ".join(f"{k[6:]} {100 * v / part['samples'].sum():.0f}"
                                               for k, v in stalls.head(top).items() if v)})
        claimed |= body
    rest = df[~claimed]
    rows.append({"loop": "outside loops", "instructions": int((~claimed).sum()), "holds": "-",
                 "samples %": round(100 * rest["samples"].sum() / total, 1),
                 "executed (M)": round(rest["Instructions Executed"].sum() / 1e6, 2), "top stalls %": ""})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25, help="instructions with the most samples to list")
    a = p.parse_args(argv)
    df = load(a.csv)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_colwidth", 90)
    print(f"{len(df)} instructions, {int(df['samples'].sum())} samples")
    print(summarize(df).to_string(index=False))
    stall_cols = stall_columns(df)
    hot = df.nlargest(a.top, "samples").copy()
    hot["top stall"] = hot[stall_cols].idxmax(axis=1).str[6:]
    hot["%"] = (100 * hot["samples"] / df["samples"].sum()).round(1)
    print(hot[["offset", "source", "%", "top stall"]].assign(offset=hot["offset"].map(hex)).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
