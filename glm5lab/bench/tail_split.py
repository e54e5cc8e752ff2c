"""A prototype measured against the default: the last tokens of a multi-wave fp8_ds_mla call split, so that the call's
last programs are short and fill the slots its first ones leave (NOTES.md v44).

`wave_spread` showed where the paired kernel's time goes at 512 tokens: of the two CTAs a SM, one runs ~10% slower
than the other, every wave; at the end the faster slots run out of programs while the slower ones still hold whole
tokens, so for the call's last ~15-30 us fewer than 90% of the slots work. Whole-token programs cannot fill that. Here
tokens [0, whole) run one program each (the paired tile, letting the next grid launch from its start) and tokens
[whole, T) `splits` programs each (the paired tile again, launched as that grid's dependent: its programs take the
slots the first grid's programs leave while its last ones run), then the merge of their partials. Both grids and the
merge in one CUDA graph, timed in interleaved rounds beside the default on the same inputs.

    PYTHONPATH=. python -m glm5lab.bench.tail_split --out results/kernels/tail_split_h200.csv
"""
from __future__ import annotations

import argparse
import sys

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors

SUITE = "sparse_mla_tail_split"
DEFAULT_PLANS = ((264, 2), (330, 2), (396, 2), (264, 4), (396, 4), (448, 4))


def paired_tile(heads: int) -> dict:
    """The paired kernel's default tile for `heads` (<= 16), forced whatever the token count."""
    from glm5lab.kernels import sparse_mla_sm90 as sm

    if not 1 <= heads <= 16:
        raise Glm5labError(f"the tail split runs the paired fp8_ds_mla kernel: 1-16 heads, got {heads}")
    return dict(sm.ROWS_FP8_PAIRED_CONFIG if heads > 8 else sm.ROWS_FP8_PAIRED_8_CONFIG)


def check_plan(tokens: int, whole: int, splits: int) -> None:
    """Refuse a plan that leaves nothing to one of its grids or splits outside 2-16."""
    if not 0 < whole < tokens:
        raise Glm5labError(f"the tail split needs 0 < whole < tokens, got whole {whole} of {tokens} tokens")
    if not 2 <= splits <= 16:
        raise Glm5labError(f"the tail's splits must be 2-16, got {splits}")


def tail_split_attention(q, kv_cache, slots, softmax_scale: float, whole: int, splits: int = 2, out=None, lse=None,
                         _stamps=(None, None)):
    """sparse_mla_attention's result for an fp8_ds_mla cache, tokens [0, whole) one program each and [whole, T) split
    in `splits` programs each, the second grid launched as the first one's dependent (sm_90, CUDA). _stamps: each
    grid's wave-stamp buffer (`wave_spread`), a diagnostic."""
    import torch

    from glm5lab.kernels.sparse_mla import LATENT, sparse_mla_attention

    T, H = q.shape[0], q.shape[1]
    check_plan(T, whole, splits)
    tile = {**paired_tile(H), "impl": "gluon"}
    out = torch.empty(T, H, LATENT, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device) if lse is None else lse
    sparse_mla_attention(q[:whole], kv_cache, slots[:whole], softmax_scale, num_splits=1, out=out[:whole],
                         lse=lse[:whole], _config={**tile, "_trigger_dependents": True, "_stamps": (_stamps[0], None)})
    sparse_mla_attention(q[whole:], kv_cache, slots[whole:], softmax_scale, num_splits=splits, out=out[whole:],
                         lse=lse[whole:], _config={**tile, "_dependent_launch": True, "pdl": False,
                                               "_stamps": (_stamps[1], None)})
    return out, lse


def stamped_programs(q, cache, slots, scale: float, plan) -> list:
    """(grid, sm, start_ns, end_ns) of every program of one call in a replayed CUDA graph, from the wave stamps: the
    default's (plan None: grid 1 only) or a (whole, splits) plan's two grids (the merge is not stamped)."""
    import torch

    from glm5lab.bench.kernel_bench import capture_graph
    from glm5lab.bench.wave_spread import programs_of
    from glm5lab.kernels.sparse_mla import STAMP_SLOTS, sparse_mla_attention

    T = q.shape[0]
    bufs = [torch.full((16 * T, STAMP_SLOTS.value), -1, dtype=torch.int64, device=q.device) for _ in range(2)]
    def call():
        if plan is None:
            sparse_mla_attention(q, cache, slots, scale, _config={"impl": "gluon", "_stamps": (bufs[0], None)})
        else:
            tail_split_attention(q, cache, slots, scale, *plan, _stamps=tuple(bufs))

    graph = capture_graph([call])
    graph.replay()
    torch.cuda.synchronize()
    return [(g, *p) for g, b in enumerate(bufs, 1) for p in programs_of(b.tolist())]


def run(out_csv: str, heads=(16, 8), tokens=(512,), plans=DEFAULT_PLANS, rounds: int = 15, topk: int = 2048,
        num_slots: int = 524288, command: str = "", verbose: bool = True, programs_csv: str | None = None) -> list:
    """Each (heads, tokens): the default and every (whole, splits) plan in `plans` as CUDA graphs over the same
    rotating input sets, timed in `rounds` interleaved rounds; each plan's largest error against the default's
    output (relative to its largest value) and lse (absolute) on the first set; rows appended to out_csv. With
    programs_csv, one more call of each on the first set with wave stamps (`stamped_programs`): its programs there
    (implementation "<name>:grid<g>") and `wave_spread.spread_parts` of all its programs in out_csv."""
    import torch
    from tqdm.auto import tqdm

    from glm5lab.bench.kernel_bench import graph_timer, input_sets, rotating_sets
    from glm5lab.bench.power_probe import random_fp8_cache
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import interleaved_samples, need_gpu, paired_quantiles, quantiles
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    for T in tokens:
        for whole, splits in plans:
            check_plan(T, whole, splits)
    for H in heads:
        paired_tile(H)
    need_gpu("the tail split")
    gen = torch.Generator(device="cuda").manual_seed(44)
    cache = random_fp8_cache(num_slots, gen)
    scale = mla_softmax_scale()
    rows, kept = [], []
    for H, T in tqdm([(h, t) for h in heads for t in tokens], desc="tail split", disable=not verbose):
        sets = input_sets(T, H, topk, num_slots, max(2, rotating_sets(T, topk)), gen)
        calls = {"default": [lambda q=q, s=s: sparse_mla_attention(q, cache, s, scale) for q, s in sets]}
        for whole, splits in plans:
            calls[f"tail{whole}x{splits}"] = [lambda q=q, s=s, w=whole, k=splits: tail_split_attention(
                q, cache, s, scale, w, k) for q, s in sets]
        want = calls["default"][0]()
        shape = f"H{H}_T{T}_K{topk}"
        base = {"suite": SUITE, "shape": shape, "dtype": "bf16", "layout": "fp8_ds_mla"}
        for name, fns in calls.items():
            if name != "default":
                got = fns[0]()
                scale_o = want[0].float().abs().max().item()
                rows += [{**base, "implementation": name, "metric": "max_rel_err_vs_default",
                          "value": (got[0].float() - want[0].float()).abs().max().item() / scale_o, "unit": "-"},
                         {**base, "implementation": name, "metric": "max_lse_err_vs_default",
                          "value": (got[1] - want[1]).abs().max().item(), "unit": "-"}]
        if programs_csv:
            from glm5lab.bench import wave_spread

            slots_n = torch.cuda.get_device_properties(0).multi_processor_count * paired_tile(H)["resident"]
            for name, plan in [("default", None), *((f"tail{w}x{k}", (w, k)) for w, k in plans)]:
                progs = stamped_programs(sets[0][0], cache, sets[0][1], scale, plan)
                parts = wave_spread.spread_parts([p[1:] for p in progs], slots_n)
                rows += [{**base, "implementation": name, "metric": k, "value": v,
                          "unit": "us" if k.endswith("_us") else "-"} for k, v in parts.items()]
                kept += [{**row, "implementation": f"{name}:grid{g}"} for row, (g, *_) in
                         zip(wave_spread.program_rows([p[1:] for p in progs], name, shape, slots_n), progs)]
                if verbose:
                    tqdm.write(f"  {shape} {name:>12} stamped: " + " ".join(f"{k} {v:.3g}" for k, v in parts.items()))
        timers = {name: graph_timer(fns) for name, fns in calls.items()}
        samples = interleaved_samples(timers, rounds)
        for name, xs in samples.items():
            q = quantiles(xs)
            rows.append({**base, "implementation": name, "metric": "time_graph", "value": q["p50"], "unit": "us", **q})
            if name != "default":
                r = paired_quantiles(lambda a, b: a / b, samples["default"], xs)
                rows.append({**base, "implementation": name, "metric": "speedup_vs_default", "value": r["p50"],
                             "unit": "x", **r})
            if verbose:
                tqdm.write(f"  {shape} {name:>12}: {q['p50']:.1f} us (p20 {q['p20']:.1f}, p80 {q['p80']:.1f})")
    append_rows(out_csv, rows, command=command or "python -m glm5lab.bench.tail_split")
    if programs_csv:
        from glm5lab.bench import wave_spread

        wave_spread.write_programs(programs_csv, kept, command or "python -m glm5lab.bench.tail_split")
    return rows


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.tail_split", description=first_paragraph(__doc__))
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--plans", nargs="+", metavar="WHOLExSPLITS",
                    help="default: %s" % " ".join(f"{w}x{k}" for w, k in DEFAULT_PLANS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--programs", help="(gzip) CSV: one stamped call's programs of the default and each plan")
    ap.add_argument("--png", help="plot the programs CSV (wave_spread.plot) into this file")
    args = ap.parse_args(argv)
    plans = DEFAULT_PLANS
    if args.plans:
        try:
            plans = tuple((int(w), int(k)) for w, k in (p.split("x") for p in args.plans))
        except ValueError:
            raise Glm5labError(f"--plans takes WHOLExSPLITS, got {args.plans}") from None
    run(args.out, tuple(args.heads), tuple(args.tokens), plans, args.rounds,
        command=command_line("glm5lab.bench.tail_split", argv), programs_csv=args.programs)
    if args.png and args.programs:
        from glm5lab.bench import wave_spread

        wave_spread.plot(args.programs, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
