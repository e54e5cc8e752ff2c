"""Time the split merge kernels alone on the GPU (CUDA-graph replay, the partials L2-warm as after the attention
grid that wrote them): the [splits, MH, DC] column merge against the unrolled one over its tiles, at the split
counts the policy picks. Probe behind NOTES.md v13; long-format rows to --out. --partials: instead, merge_plan's
merge of fp32 partials against the same of fp16 partials with their scales (NOTES.md v14). --columns: instead, the
column merge's tile (heads x columns a program, warps) at the 1-8 token calls where it is the plan's (NOTES.md v24:
at 1 token x 8 heads its 32 programs load 32 KB each from L2; v27: 64 / 128 heads, fp16 partials).

    PYTHONPATH=. python scripts/merge_probe.py --out results/kernels/merge_probe_h200.csv [--partials | --columns]
"""
import argparse
import itertools
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph
from tqdm.auto import tqdm

from glm5lab.bench.records import append_rows
from glm5lab.bench.timing import need_gpu
from glm5lab.cli import first_paragraph
from glm5lab.errors import one_line_errors
from glm5lab.kernels import sparse_mla as sm

CASES = {8: [(1, 64), (8, 16), (32, 4)], 16: [(1, 32), (32, 4)], 64: [(1, 32), (8, 16), (32, 4), (64, 2)],
         128: [(4, 16), (16, 4), (32, 2)]}
# (tokens, splits) of the default policy at 1-8 tokens where merge_plan picks the column merge (fp32 partials at
# <= 16 heads; fp16 partials, with their scale plane, from the 64-head kernels)
COLUMN_CASES = {8: [(1, 64), (2, 64), (8, 16)], 16: [(1, 32), (2, 32), (8, 16)], 64: [(1, 32), (2, 32), (4, 32)],
                128: [(1, 32), (2, 32)]}


def fp16_partials(po, pl):
    """fp32 partials [T, S, H, 512] / lse [T, S, H] in the 64-head kernels' fp16 format: each partial scaled by a
    power of two into fp16 range, its columns in stored order (`stored_column`), lse and 1 / scale as two planes."""
    amax = po.abs().amax(-1)
    mul = torch.exp2(14 - torch.floor(torch.log2(amax)))
    order = torch.arange(512, device=po.device).view(32, 2, 4, 2).permute(0, 2, 1, 3).reshape(512)
    return (po * mul[..., None])[..., order].half(), torch.stack([pl, 1.0 / mul])


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--out", required=True, help="CSV to append long-format rows to")
    p.add_argument("--heads", type=int, nargs="*", default=sorted(CASES), choices=sorted(CASES))
    p.add_argument("--partials", action="store_true", help="time fp32 against fp16 partials (merge_plan's merge)")
    p.add_argument("--columns", action="store_true", help="time the column merge's tiles at COLUMN_CASES")
    args = p.parse_args(argv)
    need_gpu("the merge probe")
    if args.partials:
        append_rows(args.out, partials_rows(args.heads), command=" ".join(sys.argv))
        return 0
    if args.columns:
        append_rows(args.out, column_rows([h for h in args.heads if h in COLUMN_CASES]), command=" ".join(sys.argv))
        return 0
    rows = []
    jobs = [(h, t, s) for h in args.heads for t, s in CASES[h]]
    for H, T, S in tqdm(jobs, desc="merge probe"):
        po = torch.randn(T, S, H, 512, device="cuda")
        pl = torch.randn(T, S, H, device="cuda") * 3
        ref_o = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16)
        ref_l = torch.empty(T, H, device="cuda")
        sp = triton.next_power_of_2(S)
        shape = f"H{H}_T{T}_S{S}"
        mh, dc, sc = sm.merge_tiles(H, S)

        def old():
            sm.launch_merge(sm._merge_columns_kernel, mh, dc, sc, po, pl, ref_o, ref_l)
        old()
        us = do_bench_cudagraph(old, rep=20) * 1e3
        rows.append({"suite": "merge_probe", "implementation": f"columns_mh{mh}_dc{dc}_sc{sc}_w4", "shape": shape,
                     "layout": "-", "dtype": "bf16", "metric": "time_graph", "value": us, "unit": "us"})
        tqdm.write(f"{shape:14s} columns mh{mh} dc{dc} sc{sc}: {us:7.2f} us")
        best = None
        for MH, DC, SC, nw in itertools.product((4, 8), (32, 64, 128, 256), (1, 2, 4, 8, 16), (4, 8)):
            if (SC > sp or MH * DC * SC > 16384 or (DC == 32 and S < 16) or (nw == 8) != (MH * DC * SC >= 8192)
                    or (S >= 16 and SC < 4)):
                continue
            out, lse = torch.empty_like(ref_o), torch.empty_like(ref_l)

            def new():
                sm.launch_merge(sm._merge_unrolled_kernel, MH, DC, SC, po, pl, out, lse, num_warps=nw)
            new()
            same = bool((out.float() - ref_o.float()).abs().max() < 1e-2)
            us = do_bench_cudagraph(new, rep=10) * 1e3
            name = f"unrolled_mh{MH}_dc{DC}_sc{SC}_w{nw}" + ("" if same else "_MISMATCH")
            rows.append({"suite": "merge_probe", "implementation": name, "shape": shape, "layout": "-",
                         "dtype": "bf16", "metric": "time_graph", "value": us, "unit": "us"})
            if best is None or us < best[0]:
                best = (us, f"mh{MH} dc{DC} sc{SC} w{nw}", same)
        tqdm.write(f"{'':14s} unrolled best {best[1]}: {best[0]:7.2f} us, matches the column merge: {best[2]}")
    append_rows(args.out, rows, command=" ".join(sys.argv))
    return 0


def column_rows(heads) -> list:
    """The column merge (every split in one load round) over tiles of MH heads x DC columns on 1-4 warps, beside
    merge_tiles' tile, on the same partials (fp32 at <= 16 heads, else fp16 as the 64-head kernels write them); a tile
    whose output differs from the plan's is named _MISMATCH."""
    rows = []
    for H, T, S in [(h, t, s) for h in heads for t, s in COLUMN_CASES[h]]:
        po = torch.randn(T, S, H, 512, device="cuda")
        pl = torch.randn(T, S, H, device="cuda") * 3
        f16 = H > sm.NARROW_MERGE_MAX_HEADS
        if f16:
            po, pl = fp16_partials(po, pl)
        sp = triton.next_power_of_2(S)
        shape, plan = f"H{H}_T{T}_S{S}", sm.merge_tiles(H, S, f16)
        plan_tile = (*plan, sm.merge_warps(sm._merge_columns_kernel, *plan))        # (MH, DC, SC, warps)
        ref_o, ref_l = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16), torch.empty(T, H, device="cuda")
        sm.launch_merge(sm._merge_columns_kernel, *plan, po, pl, ref_o, ref_l)
        tiles = [(mh, dc, nw) for mh, dc, nw in itertools.product((1, 2, 4, 8, 16), (8, 16, 32, 64), (1, 2, 4))
                 if mh <= H and mh * dc * sp <= 2048 * nw and (dc >= 16 or not f16)]   # (fp16: 16-column blocks)
        for MH, DC, nw in tqdm(tiles, desc=f"column merge tiles {shape}"):
            out, lse = torch.empty_like(ref_o), torch.empty_like(ref_l)

            def merge():
                sm.launch_merge(sm._merge_columns_kernel, MH, DC, sp, po, pl, out, lse, num_warps=nw)
            merge()
            same = bool((out.float() - ref_o.float()).abs().max() < 1e-2 and (lse - ref_l).abs().max() < 1e-5)
            us = do_bench_cudagraph(merge, rep=20) * 1e3
            name = (f"columns_mh{MH}_dc{DC}_sc{sp}_w{nw}" + ("_plan" if (MH, DC, sp, nw) == plan_tile else "")
                    + ("" if same else "_MISMATCH"))
            rows.append({"suite": "merge_probe", "implementation": name, "shape": shape, "layout": "-",
                         "dtype": "bf16", "metric": "time_graph", "value": us, "unit": "us"})
        best = min((r for r in rows if r["shape"] == shape), key=lambda r: r["value"])
        plan_us = [r["value"] for r in rows if r["shape"] == shape and "_plan" in r["implementation"]]
        tqdm.write(f"{shape:14s} plan {plan} {plan_us[0] if plan_us else float('nan'):7.2f} us; best "
                   f"{best['implementation']} {best['value']:7.2f} us")
    return rows


def partials_rows(heads) -> list:
    """merge_plan's merge over fp32 partials and over the same partials in fp16 with a scale a head (the format of
    _config={"partials": "fp16"}), side by side in one process; their outputs compared."""
    rows = []
    for H, T, S in tqdm([(h, t, s) for h in heads for t, s in CASES[h]], desc="merge probe (partials)"):
        po = torch.randn(T, S, H, 512, device="cuda")
        pl = torch.randn(T, S, H, device="cuda") * 3
        po16, planes = fp16_partials(po, pl)
        shape, plan32, plan16 = f"H{H}_T{T}_S{S}", sm.merge_plan(H, S), sm.merge_plan(H, S, fp16=True)
        kernel, mh, dc, sc = plan16
        # fp16 also at twice the plan's columns a program (the fp16 plan widens them only up to 4 splits)
        wide = (kernel, mh, min(dc * 2, 512), max(1, sc // 2) if kernel is sm._merge_columns_kernel else sc)
        outs = {}
        for name, o, lse_in, plan in (("plan_fp32", po, pl, plan32),
                                      ("plan_fp16", po16, planes, plan16),
                                      (f"plan_fp16_dc{wide[2]}", po16, planes, wide)):
            out, lse = torch.empty(T, H, 512, device="cuda", dtype=torch.bfloat16), torch.empty(T, H, device="cuda")

            def merge():
                sm.launch_merge(*plan, o, lse_in, out, lse)
            merge()
            us = do_bench_cudagraph(merge, rep=20) * 1e3
            outs[name] = out.float()
            rows.append({"suite": "merge_probe", "implementation": f"{name}_{plan[0].fn.__name__.strip('_')}",
                         "shape": shape, "layout": "-", "dtype": "bf16", "metric": "time_graph", "value": us,
                         "unit": "us"})
            tqdm.write(f"{shape:14s} {name}: {us:7.2f} us")
        for name in list(outs)[1:]:
            rows.append({"suite": "merge_probe", "implementation": f"{name}_vs_fp32", "shape": shape, "layout": "-",
                         "dtype": "bf16", "metric": "max_abs_diff",
                         "value": float((outs[name] - outs["plan_fp32"]).abs().max()), "unit": "-"})
    return rows


if __name__ == "__main__":
    sys.exit(main())
