"""How fast the GPU reads random KV-cache rows at all: the ceiling under the sparse-MLA kernels (NOTES.md v10).

The issue's roofline divides the bytes a call must read by the device-to-device copy bandwidth. Reading 2048 random
rows a token is not a copy: every row is its own short burst (656 bytes in fp8_ds_mla, 1152 in bf16). This times a
kernel that does nothing but that read -- the sparse-MLA access pattern (a token's top-k rows of a 524,288-slot
cache, random) summed into a few words a program, with tens of thousands of programs so parallelism is never short
-- beside the copy bandwidth, in one process: the fraction of the roofline a gather of those rows reaches by itself.
At 1-8 tokens the same kernel is a latency floor instead: one launch, the slot indices' load, the rows' load that
depends on it, a store -- what any kernel that reads a token's top-k slots from memory pays before it computes
anything (NOTES.md v24, the small-batch targets).

    python -m glm5lab.bench.gather_ceiling --out results/kernels/gather_ceiling_h200.csv [--tokens 1 8 512]
"""
from __future__ import annotations

import argparse
import sys

import triton
import triton.language as tl

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors

ROW_BYTES = {"fp8_ds_mla": 656, "bf16": 1152}     # glm5lab.kernels.fp8_ds_mla's row; 576 bf16 values
BLOCK_ROWS = 32


@triton.jit
def _gather_sum_kernel(CACHE, SLOTS, OUT, topk, ROW_WORDS: tl.constexpr, WORDS: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """Program (token t, row block c): read rows SLOTS[t, c*BLOCK_R : (c+1)*BLOCK_R] of the cache (int32 words,
    16-byte aligned rows) and store their column sums, so the loads cannot be dropped."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    r = c * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.load(SLOTS + t * topk + r, mask=r < topk, other=0).to(tl.int64)
    w = tl.arange(0, WORDS)
    base = tl.multiple_of(rows * ROW_WORDS, 4)
    x = tl.load(CACHE + base[:, None] + w[None, :], mask=(r < topk)[:, None] & (w < ROW_WORDS)[None, :], other=0)
    tl.store(OUT + (t * tl.num_programs(1) + c) * WORDS + w, tl.sum(x, 0))


def gather_sum(cache_words, slots, out=None, block_rows: int = BLOCK_ROWS, num_warps: int = 4):
    """Column sums of each block_rows-row block of every token's rows: [tokens, blocks, WORDS] int32 (the words
    past a row's end are 0). cache_words: [slots, row words] int32, slots: [tokens, topk] int32. The tile
    (block_rows rows a program on num_warps warps) matters at 1-8 tokens, where the programs are few."""
    import torch

    num_tokens, topk = slots.shape
    row_words = cache_words.shape[1]
    words = triton.next_power_of_2(row_words)
    blocks = triton.cdiv(topk, block_rows)
    if out is None:
        out = torch.empty(num_tokens, blocks, words, dtype=torch.int32, device=slots.device)
    _gather_sum_kernel[(num_tokens, blocks)](cache_words, slots, out, topk, ROW_WORDS=row_words, WORDS=words,
                                             BLOCK_R=block_rows, num_warps=num_warps)
    return out


def run(out_csv: str, tokens=(512,), topk: int = 2048, num_slots: int = 524288, command: str = "",
        tiles=((BLOCK_ROWS, 4),)) -> list:
    """Time the gather of each layout's rows at each token count of `tokens` (an int or a sequence) and each tile
    (block rows, warps) of `tiles` (CUDA-graph replays over rotating slot sets, as the kernel benchmark) beside the
    copy bandwidth; append long-format rows to out_csv and return them."""
    import torch

    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import copy_bandwidth_gbps

    if not torch.cuda.is_available():
        raise Glm5labError("the gather ceiling is a GPU measurement (no CUDA device here)")
    copy = copy_bandwidth_gbps()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for layout, row_bytes in ROW_BYTES.items():
        cache = torch.randint(0, 1 << 30, (num_slots, row_bytes // 4), dtype=torch.int32, device="cuda", generator=g)
        for n in ((tokens,) if isinstance(tokens, int) else tuple(tokens)):
            for block_rows, warps in tiles:
                rows += _time_gather(cache, layout, row_bytes, n, topk, num_slots, copy, g, block_rows, warps)
        cache = None
    rows.append(dict(suite="gather_ceiling", implementation="torch-copy", shape="2GiB", dtype="uint8", layout="-",
                     metric="copy_bandwidth", value=copy, unit="GB/s"))
    append_rows(out_csv, rows, command=command)
    return rows


def _time_gather(cache, layout: str, row_bytes: int, tokens: int, topk: int, num_slots: int, copy: float, g,
                 block_rows: int, warps: int) -> list:
    """Rows of one (layout, token count, tile): graph time, the bandwidth it read at, its fraction of the copy's."""
    import torch

    from glm5lab.bench.kernel_bench import graph_time_us

    sets = [torch.randint(0, num_slots, (tokens, topk), dtype=torch.int32, device="cuda", generator=g)
            for _ in range(4)]
    outs = [gather_sum(cache, s, None, block_rows, warps) for s in sets]
    us = graph_time_us([lambda s=s, o=o: gather_sum(cache, s, o, block_rows, warps) for s, o in zip(sets, outs)])
    read_gbps = tokens * topk * row_bytes / (us * 1e-6) / 1e9
    tile = "" if (block_rows, warps) == (BLOCK_ROWS, 4) else f"_R{block_rows}_W{warps}"
    row = dict(suite="gather_ceiling", implementation="triton-gather-sum",
               shape=f"T{tokens}_K{topk}_S{num_slots}{tile}", dtype="int32", layout=layout)
    print(f"{layout:11s} {tokens:4d} tokens, {block_rows:3d} rows x {warps} warps, rows of {row_bytes:4d} B: "
          f"{us:8.2f} us, {read_gbps:7.0f} GB/s read = {read_gbps / copy:.2f} of the copy bandwidth ({copy:.0f} GB/s)")
    return [{**row, "metric": metric, "value": value, "unit": unit}
            for metric, value, unit in (("time_graph", us, "us"), ("read_bandwidth", read_gbps, "GB/s"),
                                        ("fraction_of_copy_bandwidth", read_gbps / copy, "1"))]


def _tile(text: str) -> tuple[int, int]:
    """'ROWSxWARPS' -> (rows, warps): rows a power of two (the kernel's arange), warps a power of two up to 16."""
    parts = text.lower().split("x")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        rows, warps = int(parts[0]), int(parts[1])
        if rows >= 1 and rows & (rows - 1) == 0 and warps in (1, 2, 4, 8, 16):
            return rows, warps
    raise Glm5labError(f"--tiles takes ROWSxWARPS pairs (rows a power of two, warps 1/2/4/8/16), got {text!r}")


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm5lab.bench.gather_ceiling", description=first_paragraph(__doc__))
    p.add_argument("--out", required=True, help="CSV to append long-format rows to")
    p.add_argument("--tokens", type=int, nargs="+", default=[512], help="token counts (each its own shape)")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--tiles", nargs="+", default=[f"{BLOCK_ROWS}x4"], metavar="ROWSxWARPS",
                   help="program tiles to time, e.g. 16x2 32x4 64x8 (rows a program x warps)")
    args = p.parse_args(argv)
    tiles = [_tile(t) for t in args.tiles]
    run(args.out, args.tokens, args.topk, command=command_line("glm5lab.bench.gather_ceiling", argv), tiles=tiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
