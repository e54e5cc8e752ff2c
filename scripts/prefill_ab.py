"""The indexer's prefill logits kernel at several tilings (tokens a tile, keys a tile, warps, key tiles a program,
pipeline stages) and dot orders, in one process on the same inputs: one request's causal chunk of new tokens against
its keys as glm5lab's vLLM op gathers them from the fp8 index-key cache. ":q8" runs the op's path (vLLM's e4m3 q on
the (e4m3, scale) pair, the fp8 x fp8 dot), ":bf16" the op's path before v59 (q widened to bf16, the keys dequantized
to bf16). Timed with do_bench in --rounds interleaved rounds (`interleaved_samples`; the median is the row), every
config's logits checked against the first one's. Rows (metric prefill_logits_time and prefill_logits_tflops,
implementation glm5lab-triton-m<tokens>n<keys>w<warps>t<tiles>s<stages>[-kq|-qk]-<q8|bf16>) are appended to --out.

    PYTHONPATH=. python scripts/prefill_ab.py --out results/indexer/prefill_ab.csv --configs default:q8 4x64x4:kq:q8
"""
import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from glm5lab.bench.indexer_bench import prefill_flops
from glm5lab.bench.records import append_rows
from glm5lab.bench.timing import bench, interleaved_samples, need_gpu
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.kernels.dsa_indexer import dequantize_fp8_keys, indexer_logits_prefill

INPUTS = ("q8", "bf16")   # a config's ":<input>" (required): e4m3 q on the fp8 pair, or bf16 q on bf16 keys
ORDERS = {"kq": True, "qk": False}   # a config's ":<order>" -> keys_as_m; left out, the kernel's default
DEFAULT = "default"       # a config's tiling "default": the kernel's own (what the vLLM op runs)


def parse_config(text: str) -> tuple:
    """"4x64x4:q8", "4x64x4x8x2:kq:q8" or "default:qk:bf16" -> (tokens a tile, keys a tile, warps, tiles a program,
    stages, keys_as_m (None: the kernel's), input); "default" leaves the tiling to the kernel (None, None, 4, None,
    None: `prefill_tiling_default` for the dot order it runs)."""
    tiling, *flags = text.split(":")
    try:
        parts = [int(v) for v in tiling.split("x")]
    except ValueError:
        parts = []
    if len(parts) == 3:
        parts += [1, 2]
    if tiling == DEFAULT:
        parts = [None, None, 4, None, None]
    inputs = [f for f in flags if f in INPUTS]
    orders = [f for f in flags if f in ORDERS]
    if (len(parts) != 5 or min(1 if v is None else v for v in parts) < 1 or len(inputs) != 1 or len(orders) > 1
            or any(f not in (*INPUTS, *ORDERS) for f in flags)):
        raise Glm5labError(f"--configs takes <tokens>x<keys>x<warps>[x<tiles>x<stages>] or default, then [:kq|:qk] and "
                           f"one of :q8 / :bf16, e.g. 4x64x4:q8, 8x128x8x8x2:kq:q8 or default:qk:bf16; got {text!r}")
    return (*parts, ORDERS[orders[0]] if orders else None, inputs[0])


def config_name(m, n, warps, tiles, stages, keys_as_m, inp) -> str:
    tiling = DEFAULT if m is None else f"m{m}n{n}w{warps}t{tiles}s{stages}"
    order = {None: "", True: "-kq", False: "-qk"}[keys_as_m]
    return f"glm5lab-triton-{tiling}{order}-{inp}"


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=first_paragraph(__doc__))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", nargs="+",
                    default=["default:qk:q8", "default:kq:q8", "default:qk:bf16", "default:kq:bf16", "4x64x4x8x2:kq:q8",
                             "4x128x4:kq:q8"],
                    help="<tokens a tile>x<keys a tile>x<warps>[x<tiles a program>x<stages>][:kq|:qk]:<q8|bf16>; the "
                         "first is the reference the others are checked against")
    ap.add_argument("--shapes", nargs="+", default=["1024:4096", "4096:16384", "2048:65536"],
                    help="<new tokens>:<context> (the chunk is the context's last tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each config, interleaved (default 3)")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs]
    try:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes]
    except ValueError:
        shapes = [()]
    if any(len(s) != 2 or not 0 < s[0] <= s[1] for s in shapes):
        raise Glm5labError(f"--shapes takes <new tokens>:<context> with 0 < tokens <= context, got {args.shapes}")
    need_gpu("the prefill logits A/B")
    command = "python scripts/prefill_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    H, D = 32, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    rows = []
    for T, S in tqdm(shapes, desc="prefill"):
        values = (torch.randn(S, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.exp2(torch.randint(-8, -2, (S,), device="cuda", generator=gen).float())
        q8 = (torch.randn(T, H, D, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = torch.randn(T, H, device="cuda", generator=gen) / H
        ks = torch.zeros(T, dtype=torch.int32, device="cuda")
        ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device="cuda")
        inputs = {"q8": (q8, (values, scales)),
                  "bf16": (q8.to(torch.bfloat16), dequantize_fp8_keys(values, scales).to(torch.bfloat16))}
        ref = finite = None
        calls = {}
        for m, n, warps, tiles, stages, keys_as_m, inp in configs:
            name = config_name(m, n, warps, tiles, stages, keys_as_m, inp)
            q, k = inputs[inp]

            def call(q=q, k=k, m=m, n=n, warps=warps, tiles=tiles, stages=stages, keys_as_m=keys_as_m):
                return indexer_logits_prefill(q, w, k, ks, ke, max_len=S, block_m=m, block_n=n, num_warps=warps,
                                              tiles=tiles, num_stages=stages, keys_as_m=keys_as_m)
            try:
                got = call()
            except Exception as e:      # a tiling this GPU cannot build (shared memory, registers): said, not timed
                tqdm.write(f"P{T:<5d} L{S:<6d} {name:40s} not built: {type(e).__name__}: {str(e)[:200]}")
                continue
            if ref is None:
                ref, finite, atol = got, torch.isfinite(got), 1e-3 * float(got[torch.isfinite(got)].abs().max())
            # (the products are the same; the sums' order and Hopper's fp8 MMA accumulation differ)
            agree = bool(torch.equal(torch.isfinite(got), finite)
                         and torch.allclose(got[finite], ref[finite], rtol=0, atol=atol))
            rows.append({"suite": "dsa_indexer_prefill_ab", "implementation": name, "shape": f"P{T}_L{S}_H{H}_D{D}",
                         "dtype": "fp8", "layout": "gathered", "metric": "prefill_logits_match_first",
                         "value": float(agree), "unit": "bool"})
            del got
            if not agree:
                tqdm.write(f"P{T:<5d} L{S:<6d} {name:40s} gives other logits than the first config: not timed")
                continue
            calls[name] = call
        del ref, finite
        times = interleaved_samples({name: lambda call=call: bench(call)["p50"] for name, call in calls.items()},
                                    args.rounds)
        flops = prefill_flops(T, S, H, D)
        for name, got in times.items():
            us = float(torch.tensor(got).median())
            base = {"suite": "dsa_indexer_prefill_ab", "implementation": name, "shape": f"P{T}_L{S}_H{H}_D{D}",
                    "dtype": "fp8", "layout": "gathered"}
            rows.append({**base, "metric": "prefill_logits_time", "value": us, "unit": "us"})
            rows.append({**base, "metric": "prefill_logits_tflops", "value": flops / (us * 1e-6) / 1e12,
                         "unit": "TFLOP/s"})
            tqdm.write(f"P{T:<5d} L{S:<6d} {name:40s} {us:9.1f} us  {flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s  "
                       f"(rounds {' '.join(f'{v:.1f}' for v in got)})")
    append_rows(args.out, rows, command=command)
    print(f"{len(rows)} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
