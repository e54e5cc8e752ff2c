"""The indexer's decode logits kernel at several tilings (keys a tile, warps, tiles a program, pipeline stages), dot
dtypes and orders, in one process on the same paged caches, timed in CUDA graphs as the indexer bench times them
(rotating disjoint row sets, so the keys come from memory) in --rounds interleaved rounds (the median is the row),
each config's logits checked against the first one's. Rows (metric logits_time_graph and
fraction_of_copy_ceiling_graph, implementation glm5lab-triton-n<keys>w<warps>t<tiles>s<stages>[-<dot>dot][-kq|-qk]
[-pd][-q8]) are appended to --out.

    PYTHONPATH=. python scripts/logits_ab.py --out results/indexer/logits_ab.csv --configs 128x4 64x4 64x4x4x3
    PYTHONPATH=. python scripts/logits_ab.py --out ... --configs 64x4:bf16 64x4:f16 --dtypes fp8   # fp8 keys' dot
    PYTHONPATH=. python scripts/logits_ab.py --out ... --configs 128x4:qk 128x4:kq 128x4:f16:kq    # the dot's order
"""
import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from glm5lab.bench.indexer_bench import logits_bytes_read
from glm5lab.bench.kernel_bench import graph_time_us
from glm5lab.bench.records import append_rows
from glm5lab.bench.timing import copy_bandwidth_gbps, need_gpu
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.kernels.dsa_indexer import indexer_logits_decode, write_index_key_cache


DOTS = {"f16": True, "bf16": False}    # a config's ":<dot>" -> indexer_logits_decode's f16_dot
ORDERS = {"kq": True, "qk": False}     # a config's ":<order>" -> keys_as_m (kq: keys . q^T, the keys as M)
PERMUTED = "pd"                        # a config's ":pd" -> permute_d (the dot's sum in the fragments' order)
FP8_Q = "q8"                           # a config's ":q8" -> q passed as e4m3 (vLLM's): the fp8 x fp8 dot
DEFAULT = "default"                    # a config's tiling "default" -> the kernel's own for each shape


def parse_config(text: str) -> tuple:
    """"128x4", "64x4x4x3", "64x4:bf16", "128x4:f16:kq:pd" or "default:q8" -> (keys a tile, warps, tiles a program,
    stages, f16_dot, keys_as_m, permute_d, fp8_q; "default": None for keys and tiles, the kernel's):
    ":f16" runs fp8 keys' dot in fp16, ":bf16" in q's dtype (bf16 here); ":kq" takes it as keys . q^T, ":qk" as
    q . keys^T; left out, the kernel's default; ":pd" sums over D in the fragments' order; ":q8" passes q as
    e4m3 (every config's q is e4m3-representable, so all compute the same products)."""
    tiling, *flags = text.split(":")
    try:
        parts = [int(v) for v in tiling.split("x")]
    except ValueError:
        parts = []
    if len(parts) == 2:
        parts += [1, 1]
    if tiling == DEFAULT:
        parts = [None, 4, None, 2]             # the kernel's own tiling for the shape (what the vLLM op runs)
    known = {**DOTS, **ORDERS, PERMUTED: True, FP8_Q: True}
    dots = [f for f in flags if f in DOTS]
    orders = [f for f in flags if f in ORDERS]
    if (len(parts) != 4 or min(1 if v is None else v for v in parts) < 1 or any(f not in known for f in flags)
            or len(dots) > 1 or len(orders) > 1 or flags.count(PERMUTED) > 1 or flags.count(FP8_Q) > 1
            or (FP8_Q in flags and dots)):
        raise Glm5labError(f"--configs takes <keys>x<warps>[x<tiles>x<stages>] or default, then [:f16|:bf16][:kq|:qk]"
                           f"[:pd][:q8] (:q8 without a dot flag), e.g. 128x4, 64x4x4x3, 64x4:bf16, 128x4:f16:kq:pd, "
                           f"64x4:kq:q8 or default:q8; got {text!r}")
    return (*parts, DOTS[dots[0]] if dots else None, ORDERS[orders[0]] if orders else None, PERMUTED in flags,
            FP8_Q in flags)


def config_name(n, warps, tiles, stages, f16_dot, keys_as_m=None, permute_d=False, fp8_q=False) -> str:
    dot = {None: "", True: "-f16dot", False: "-bf16dot"}[f16_dot]
    order = {None: "", True: "-kq", False: "-qk"}[keys_as_m]
    tiling = DEFAULT if n is None else f"n{n}w{warps}t{tiles}s{stages}"
    return (f"glm5lab-triton-{tiling}{dot}{order}{'-pd' if permute_d else ''}"
            f"{'-q8' if fp8_q else ''}")


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=first_paragraph(__doc__))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", nargs="+", default=["128x4", "64x4", "64x4x4x3", "128x4x4x3", "128x8x4x3"],
                    help="<keys a tile>x<warps>[x<tiles a program>x<stages>]; the first is the reference the others "
                         "are checked against")
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 65536])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--rounds", type=int, default=3, help="timings of each config, interleaved (default 3)")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs]
    need_gpu("the logits A/B")
    command = "python scripts/logits_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    H, D, page = 32, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    maxB, maxL = max(args.batches), max(args.contexts)
    per_row = -(-maxL // page)
    n_blocks = max(maxB, 8) * per_row
    keys = torch.randn(n_blocks, page, D, device="cuda", generator=gen).to(torch.bfloat16)
    caches = {"bf16": keys}
    if "fp8" in args.dtypes:
        caches["fp8"] = torch.empty(n_blocks, page, D + 4, device="cuda", dtype=torch.uint8)
        write_index_key_cache(caches["fp8"], keys.view(-1, D), torch.arange(n_blocks * page, device="cuda"))
    table_all = torch.randperm(n_blocks, device="cuda", generator=gen).int().view(-1, per_row)
    bw = copy_bandwidth_gbps()
    rows = []
    for dt, L, B in tqdm([(d, L, B) for d in args.dtypes for L in args.contexts for B in args.batches], desc="logits"):
        q = torch.randn(B, H, D, device="cuda", generator=gen).to(torch.float8_e4m3fn).to(torch.bfloat16)
        q8 = q.to(torch.float8_e4m3fn)                                    # exact
        w = torch.randn(B, H, device="cuda", generator=gen) / H
        lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)
        blocks = -(-L // page)
        tables = [table_all[i:i + B, :blocks].contiguous() for i in range(0, table_all.shape[0] - B + 1, B)]
        tables = tables * -(-8 // len(tables))
        out = torch.empty(B, L, device="cuda")
        ref = None
        calls = {}
        for n, warps, tiles, stages, f16_dot, keys_as_m, permute_d, fp8_q in configs:
            if (f16_dot or fp8_q) and dt != "fp8":
                continue                         # the fp16 dot and the fp8 x fp8 dot are fp8 keys' only
            name = config_name(n, warps, tiles, stages, f16_dot, keys_as_m, permute_d, fp8_q)

            def call(t, n=n, warps=warps, tiles=tiles, stages=stages, f16_dot=f16_dot, keys_as_m=keys_as_m,
                     permute_d=permute_d, fp8_q=fp8_q):
                return indexer_logits_decode(q8 if fp8_q else q, w, caches[dt], t, lengths, max_len=L, out=out,
                                             block_n=n, num_warps=warps, tiles=tiles, num_stages=stages,
                                             f16_dot=f16_dot, keys_as_m=keys_as_m, permute_d=permute_d)
            got = call(tables[0]).clone()
            if ref is None:
                ref = got
            elif not torch.allclose(got, ref, rtol=1e-5, atol=1e-3 * float(ref.abs().max()) if fp8_q else 1e-5):
                # (the fp8 x fp8 dot's products are the same, its fp32 sums not: Hopper's fp8 MMA adds with fewer
                # mantissa bits)
                raise Glm5labError(f"{dt} B{B} L{L}: {name} gives other logits")
            calls[name] = call
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(graph_time_us([lambda t=t, call=call: call(t) for t in tables]))
        for name, got in times.items():
            us = float(torch.tensor(got).median())
            base = {"suite": "dsa_indexer_logits_ab", "implementation": name,
                    "shape": f"B{B}_L{L}_H{H}_D{D}", "dtype": dt, "layout": f"paged{page}"}
            rows.append({**base, "metric": "logits_time_graph", "value": us, "unit": "us"})
            frac = logits_bytes_read(B, L, H, D, dt) / (us * 1e-6) / 1e9 / bw
            rows.append({**base, "metric": "fraction_of_copy_ceiling_graph", "value": frac, "unit": "ratio"})
            tqdm.write(f"{dt:4s} B{B:<4d} L{L:<6d} {name:34s} {us:8.1f} us  {frac:5.3f} of copy  "
                       f"(rounds {' '.join(f'{v:.1f}' for v in got)})")
    append_rows(args.out, rows, command=command)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
