"""How much of a sparse-MLA kernel's time is spent per program rather than per row: the same rows moved as more,
shorter token rows or fewer, longer ones (tokens x top-k held constant, e.g. 1024 x 1024, 512 x 2048, 256 x 4096),
fp8_ds_mla, one split a token, CUDA-graph time in interleaved rounds. A kernel whose per-program head and tail
(first gathers, last steps, merge and store) cost time shows it as microseconds falling with longer rows at equal
bytes (NOTES.md v35 call 6: ~6-7 us a one-token program at 16 heads, and ~2.7 us an item even in the persistent
8-head kernel). Long-format rows to --out; on a machine without .git set GLM5LAB_GIT_SHA (as gpu_run.sh does).

    PYTHONPATH=. python scripts/cta_length_probe.py --heads 16 --variants ws8x2sokp ws8x2sod3 \
        --shapes 1024x1024 512x2048 256x4096 --out results/kernels/cta_length_probe_h200.csv
"""
import argparse
import functools
import sys

import torch
from tqdm.auto import tqdm

from glm5lab.bench import kernel_bench as kb
from glm5lab.bench.records import append_rows
from glm5lab.bench.timing import interleaved_samples, need_gpu, quantiles
from glm5lab.cli import first_paragraph
from glm5lab.errors import one_line_errors
from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
from glm5lab.kernels.sparse_mla import sparse_mla_attention
from glm5lab.sparse.reference import mla_softmax_scale


def shape_arg(s: str) -> tuple[int, int]:
    tokens, topk = s.lower().split("x")
    return int(tokens), int(topk)


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--variants", nargs="+", required=True, help="kernel_bench.GLUON_VARIANTS names")
    p.add_argument("--shapes", nargs="+", type=shape_arg, default=[(1024, 1024), (512, 2048), (256, 4096)],
                   help="TOKENSxTOPK")
    p.add_argument("--slots", type=int, default=524288)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    need_gpu("cta_length_probe")
    known = dict(kb.gluon_variants(",".join(a.variants), source="--variants"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = quantize_fp8_ds_mla(torch.randn(a.slots // 64, 64, 576, device="cuda", generator=gen).to(torch.bfloat16))
    scale = mla_softmax_scale()
    timers = {}
    for tokens, topk in tqdm(a.shapes, desc="inputs and graphs"):
        sets = kb.input_sets(tokens, a.heads, topk, a.slots, kb.rotating_sets(tokens, topk), gen)
        for v in a.variants:
            cfg = {**known[v], "impl": "gluon"}
            calls = [functools.partial(sparse_mla_attention, q, cache, slots, scale, num_splits=1, _config=cfg)
                     for q, slots in sets]
            timers[(v, tokens, topk)] = kb.graph_timer(calls)
    samples = interleaved_samples(timers, a.rounds)
    rows = []
    for (v, tokens, topk), xs in samples.items():
        q = quantiles(xs)
        rows.append({"suite": "cta_length_probe", "implementation": f"glm5lab-gluon-{v}",
                     "shape": f"H{a.heads}_T{tokens}_K{topk}", "dtype": "bfloat16", "layout": "fp8_ds_mla",
                     "metric": "time_graph_interleaved", "value": q["p50"], "unit": "us", **q})
        print(f"{v:12s} H{a.heads} {tokens:5d} x {topk:5d}: {q['p50']:8.1f} us "
              f"(p20 {q['p20']:.1f}, p80 {q['p80']:.1f})")
    append_rows(a.out, rows, command="scripts/cta_length_probe.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
