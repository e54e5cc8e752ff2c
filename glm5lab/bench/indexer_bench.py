"""DSA indexer benchmark: time per decode step of glm5lab's Triton indexer (paged logits + top-k) vs
the torch version (gather the keys through the block table, batched matmul, relu, weighted head sum,
torch.topk), at GLM-5's sizes: 32 index heads x 128, index_topk 2048, page 64, contexts 4k-64k,
batch 1-256, bf16 and vLLM's fp8 index-key cache layout (issue 9).

For each shape: median time of logits (for fp8 keys also with an e4m3 q, as vLLM hands it over: `_e4m3_q_rows`),
top-k (each kernel, and torch.topk) and the whole step as glm5lab's indexer op runs it (the top-k kernel
`fastest_topk_method` picks; glm5lab.bench.timing.bench: CUDA events, L2 flushed, launch overhead included: at batch
1 most of the logits' time), on a GPU also the CUDA-graph time of logits and step as a captured decode step sees
them (`_graph_times`), the bytes the logits kernel must read (keys of every context token + q + weights + the logits
it writes) against the device copy bandwidth measured in the same run, and a correctness check (rows of the step's
top-k that obey the tie rule on the torch logits, within the logits tolerance).
Prefill (`_prefill_rows`): one request's chunk of new tokens against its fp8 keys as the op gathers them, with the
e4m3 q against the widened q and dequantized keys it replaced (time, TFLOP/s, the op's time for the chunk).
CPU profile: tiny shapes under the interpreter; exercises the code path, never reported as speed.

    PYTHONPATH=. python -m glm5lab.bench.indexer_bench --out results/indexer/indexer_bench_h200.csv
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import one_line_errors

SUITE = "dsa_indexer"


@dataclass
class Profile:
    name: str
    heads: int
    head_dim: int
    topk: int
    page: int
    contexts: tuple
    batches: tuple
    dtypes: tuple          # "bf16" and/or "fp8" (vLLM's fp8 index-key cache layout)
    check_rows: int        # rows per shape checked against the torch logits
    torch_max_elems: int   # skip the torch baseline above batch x context (its [B, H, L] intermediate)
    prefill: tuple = ()    # (new tokens, context) of one request's prefill chunk, timed with fp8 keys


# (batch 8 since v59: the projection's batch-8 rows had taken the indexer's batch-1 rows, the nearest measured)
PROFILES = {
    "gpu": Profile("gpu", 32, 128, 2048, 64, (4096, 16384, 65536), (1, 8, 32, 128, 256), ("bf16", "fp8"), 4,
                   256 * 65536, ((1024, 4096), (4096, 16384), (2048, 65536))),
    "cpu": Profile("cpu", 8, 128, 32, 16, (64, 160), (1, 3), ("bf16", "fp8"), 3, 1 << 30, ((5, 40),)),
}


def torch_indexer_step(q, weights, key_flat, block_table, lengths, page, topk):
    """The straightforward torch step on a dequantized key cache [slots, D]."""
    import torch

    L = int(lengths.max())
    pos = torch.arange(L, device=q.device)
    slots = block_table[:, pos // page].long() * page + pos % page                # [B, L]
    keys = key_flat[slots]                                                        # [B, L, D]
    scores = torch.bmm(q, keys.transpose(1, 2)).float().relu_()                   # [B, H, L]
    logits = torch.bmm(weights[:, None, :], scores)[:, 0]                         # [B, L]
    logits = logits.masked_fill(pos[None, :] >= lengths[:, None], float("-inf"))
    return logits, torch.topk(logits, min(topk, L), dim=1).indices


def logits_bytes_read(B, L, H, D, dtype):
    key_bytes = D + 4 if dtype == "fp8" else 2 * D
    return B * L * key_bytes + B * H * D * 2 + B * H * 4 + B * L * 4    # keys + q + weights + logits out


def _graph_times(logits_fn, step_fn, topk_fns: dict, block_table_all, batch: int, blocks: int) -> dict:
    """CUDA-graph time (us) of the logits kernel, the whole step and each top-k kernel of `topk_fns` ({name: fn};
    under "topk", by name), as vLLM's captured decode sees them (no launch overhead: do_bench's time includes it --
    most of the logits' at batch 1, and most of the multi-launch "split" top-k's: 148 against ~37 us at 64k positions
    on an H100, v50, so which top-k is fastest in a graph is measured here, not read off do_bench). `logits_fn(table)`
    / `step_fn(table)` run on one block table; the graph rotates through all the disjoint row sets of
    `block_table_all` (>= 138 MB of fp8 keys at 4k context, well over the H100's / H200's 50 MB L2), so each call reads
    its keys from memory, not from the previous call's L2. The top-k calls read the logits just written, as in a step.
    A graph holds at least 8 calls, so that its own launch is not a call's time (latency_anatomy found it in one-call
    graphs, v27)."""

    from glm5lab.bench.kernel_bench import graph_time_us

    return {"logits": _rotating_graph_time(logits_fn, block_table_all, batch, blocks),
            "step": _rotating_graph_time(step_fn, block_table_all, batch, blocks),
            "topk": {name: graph_time_us([fn] * 8) for name, fn in topk_fns.items()}}


def _rotating_graph_time(fn, block_table_all, batch: int, blocks: int) -> float:
    """CUDA-graph time (us) a call of `fn(table)`, the graph rotating through the disjoint row sets of
    `block_table_all` (at least 8 calls): see `_graph_times`."""
    from glm5lab.bench.kernel_bench import graph_time_us

    tables = [block_table_all[i:i + batch, :blocks].contiguous()
              for i in range(0, block_table_all.shape[0] - batch + 1, batch)]
    tables = tables * -(-8 // len(tables))
    return graph_time_us([lambda t=t: fn(t) for t in tables])


def _e4m3_q_rows(base, q, w, cache, bt, lengths, L, block_table_all, nbytes, bw, cuda) -> list[dict]:
    """The fp8 keys' logits with q as vLLM's indexer hands it over: float8_e4m3fn, its scale folded into the weights, as
    glm5lab's vLLM op passes it on since v58; the tensor cores take e4m3 x e4m3 (FP8_DOT, NOTES v57). The main
    rows keep a bf16 q (the kernel's API, and the widened q before v58). Rows "glm5lab-triton-q8": time
    (do_bench; on a GPU also graph-timed), fraction of the copy ceiling (the same bytes: q's bytes are not the
    point), and whether its logits agree with the widened q's within 1e-3 of the largest (the products are equal;
    Hopper's fp8 MMA sums with fewer bits)."""
    import torch

    from glm5lab.bench.timing import bench
    from glm5lab.kernels.dsa_indexer import indexer_logits_decode

    q8 = q.to(torch.float8_e4m3fn)
    widened = indexer_logits_decode(q8.to(torch.bfloat16), w, cache, bt, lengths, max_len=L)
    out = torch.empty_like(widened)

    def q8_fn(table=bt):
        return indexer_logits_decode(q8, w, cache, table, lengths, max_len=L, out=out)

    q8_fn()
    agree = bool(torch.allclose(out, widened, rtol=0, atol=1e-3 * float(widened.abs().max())))
    t = bench(q8_fn)
    impl = "glm5lab-triton-q8"
    rows = [{**base, "implementation": impl, "metric": "logits_time", "value": t["p50"], "unit": "us", **t},
            {**base, "implementation": impl, "metric": "logits_match_widened_q", "value": float(agree),
             "unit": "bool"}]
    if bw:
        rows.append({**base, "implementation": impl, "metric": "fraction_of_copy_ceiling",
                     "value": nbytes / (t["p50"] * 1e-6) / 1e9 / bw, "unit": "ratio"})
    if cuda:
        g = _rotating_graph_time(q8_fn, block_table_all, bt.shape[0], bt.shape[1])
        rows.append({**base, "implementation": impl, "metric": "logits_time_graph", "value": g, "unit": "us"})
        if bw:
            rows.append({**base, "implementation": impl, "metric": "fraction_of_copy_ceiling_graph",
                         "value": nbytes / (g * 1e-6) / 1e9 / bw, "unit": "ratio"})
    return rows


def prefill_flops(T: int, S: int, H: int, D: int) -> float:
    """The products a causal prefill chunk of T new tokens at the end of an S-key context needs: token t sees
    S - T + t + 1 keys, each a dot of H heads x D."""
    return 2.0 * H * D * (T * (S - T) + T * (T + 1) / 2)


# key tiles a prefill program, timed beside the default (`prefill_tiling_default`: 16 on Hopper, one elsewhere): the
# query tile (4 tokens x 32 heads x 128) is 2-4x a 64-key tile's bytes, loaded once a program
PREFILL_TILES = (8, 32)


def _prefill_rows(fp8_cache, prof, T: int, S: int, gen) -> tuple[list[dict], dict]:
    """One request's prefill chunk against fp8 index keys: the logits with vLLM's e4m3 q and the (e4m3, scale) pair
    gathered from the cache as they are (glm5lab's vLLM op since v59), against what the op ran before -- q widened
    to bf16 and the keys dequantized (float32, then bf16) before a bf16 kernel. Rows: logits time and TFLOP/s of
    each ("glm5lab-triton-q8" / "glm5lab-triton"; "-tiles<n>": n key tiles a program, the default's stages; "-qk":
    v59's kernel -- q . keys^T, one tile a program -- where the default is keys . q^T), the op's time for the chunk
    (gather + logits, `prefill_op_time`), and whether the two logits agree within 1e-3 of the largest (the products
    are equal: e4m3 x a power of two is exact in bf16; the sums' order and Hopper's fp8 accumulation differ) and the
    tiled e4m3 logits the untiled ones (the same sums)."""
    import torch

    from glm5lab.bench.timing import bench
    from glm5lab.kernels.dsa_indexer import (dequantize_fp8_keys, fp8_cache_views, indexer_logits_prefill,
                                             prefill_keys_as_m_default)
    from glm5lab.kernels.host import cuda_capability

    H, D, page = prof.heads, prof.head_dim, prof.page
    dev = fp8_cache.device
    values, scales = fp8_cache_views(fp8_cache, D)
    slots = torch.randperm(fp8_cache.shape[0] * page, device=dev, generator=gen)[:S]
    blk, off = slots // page, slots % page
    q8 = (torch.randn(T, H, D, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.randn(T, H, device=dev, generator=gen) / H
    ks = torch.zeros(T, dtype=torch.int32, device=dev)
    ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device=dev)

    def gather():          # the chunk's keys as the op gathers them from the fp8 cache
        return values[blk, off], scales[blk, off]

    def widened(pair):     # what the op handed the kernel before v59: the keys dequantized, then bf16
        return dequantize_fp8_keys(*pair).to(torch.bfloat16)

    pair, q_bf16 = gather(), q8.to(torch.bfloat16)
    keys_bf16 = widened(pair)

    def new_op():
        return indexer_logits_prefill(q8, w, gather(), ks, ke, max_len=S)

    def old_op():
        return indexer_logits_prefill(q8.to(torch.bfloat16), w, widened(gather()), ks, ke, max_len=S)

    timers = {"glm5lab-triton-q8": (lambda: indexer_logits_prefill(q8, w, pair, ks, ke, max_len=S), new_op),
              "glm5lab-triton": (lambda: indexer_logits_prefill(q_bf16, w, keys_bf16, ks, ke, max_len=S), old_op)}
    wide = timers["glm5lab-triton"][0]()
    narrow = timers["glm5lab-triton-q8"][0]()
    finite = torch.isfinite(wide)
    agree = bool(torch.equal(finite, torch.isfinite(narrow)) and torch.allclose(
        narrow[finite], wide[finite], rtol=0, atol=1e-3 * float(wide[finite].abs().max())))
    # the tiling: more key tiles a program load each query tile fewer times (timed beside the default, logits only)
    for tiles in PREFILL_TILES:
        timers[f"glm5lab-triton-q8-tiles{tiles}"] = (
            lambda tiles=tiles: indexer_logits_prefill(q8, w, pair, ks, ke, max_len=S, tiles=tiles), None)
        timers[f"glm5lab-triton-tiles{tiles}"] = (
            lambda tiles=tiles: indexer_logits_prefill(q_bf16, w, keys_bf16, ks, ke, max_len=S, tiles=tiles), None)
    # where the default dot order is keys . q^T (Hopper, v60), the other order beside it ("-qk": v59's kernel, whose
    # tiling default is one tile a program)
    if q8.is_cuda and prefill_keys_as_m_default(cuda_capability(q8.device)):
        timers["glm5lab-triton-q8-qk"] = (
            lambda: indexer_logits_prefill(q8, w, pair, ks, ke, max_len=S, keys_as_m=False), None)
        timers["glm5lab-triton-qk"] = (
            lambda: indexer_logits_prefill(q_bf16, w, keys_bf16, ks, ke, max_len=S, keys_as_m=False), None)
    tiled = timers[f"glm5lab-triton-q8-tiles{PREFILL_TILES[0]}"][0]() if PREFILL_TILES else narrow
    agree = agree and bool(torch.allclose(tiled, narrow, rtol=0, atol=1e-5 * float(wide[finite].abs().max())))
    del wide, narrow, tiled
    flops = prefill_flops(T, S, H, D)
    base = {"suite": SUITE, "shape": f"P{T}_L{S}_H{H}_D{D}", "dtype": "fp8", "layout": "gathered"}
    rows, summary = [], {"prefill_tokens": T, "context": S}
    for impl, (logits_fn, op_fn) in timers.items():
        t = bench(logits_fn)
        tflops = flops / (t["p50"] * 1e-6) / 1e12
        rows += [{**base, "implementation": impl, "metric": "prefill_logits_time", "value": t["p50"], "unit": "us",
                  **t},
                 {**base, "implementation": impl, "metric": "prefill_logits_tflops", "value": tflops,
                  "unit": "TFLOP/s"}]
        summary[f"{impl}_us"] = t["p50"]
        if op_fn is not None:
            t_op = bench(op_fn)
            rows.append({**base, "implementation": impl, "metric": "prefill_op_time", "value": t_op["p50"],
                         "unit": "us", **t_op})
            summary[f"{impl}_op_us"] = t_op["p50"]
    rows.append({**base, "implementation": "glm5lab-triton-q8", "metric": "prefill_logits_match_widened",
                 "value": float(agree), "unit": "bool"})
    summary["agree"] = agree
    return rows, summary


def prefill_table(rows):
    """The prefill rows of an indexer_bench CSV (path or DataFrame), the latest run's: logits time (us) and TFLOP/s
    per chunk shape and implementation, and the op's time for the chunk (gather + logits)."""
    import pandas as pd

    df = pd.read_csv(rows) if not isinstance(rows, pd.DataFrame) else rows
    d = df[df.metric.isin(["prefill_logits_time", "prefill_logits_tflops", "prefill_op_time"])].copy()
    if d.empty:
        return pd.DataFrame()
    if "timestamp" in d:         # (append_rows stamps a run's rows alike)
        d = d[d.timestamp == d.timestamp.max()]
    d["value"] = pd.to_numeric(d.value, errors="coerce")
    return d.pivot_table(index=["shape", "implementation"], columns="metric", values="value", aggfunc="last")


def run(csv_path, profile: str = "gpu", *, contexts=None, batches=None, command: str = "",
        verbose: bool = True, prefill: bool = True):
    """Run the benchmark for `profile` ("gpu" or "cpu"), append rows to csv_path, return a summary
    pandas DataFrame (one row per decode shape and dtype); with `prefill`, also the profile's prefill chunks
    (`_prefill_rows`, printed as a second table)."""
    import pandas as pd
    import torch

    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import bench, copy_bandwidth_gbps, pick_profile
    from glm5lab.kernels.dsa_indexer import (dequantize_index_key_cache, fastest_topk_method, indexer_logits_decode,
                                             indexer_topk, write_index_key_cache)
    from glm5lab.sparse.indexer_reference import topk_sets_agree

    prof, dev = pick_profile(PROFILES, profile)
    cuda = dev == "cuda"
    contexts = tuple(contexts or prof.contexts)
    batches = tuple(batches or prof.batches)
    H, D, K, page = prof.heads, prof.head_dim, prof.topk, prof.page
    log = (lambda *a: print(*a, flush=True)) if verbose else (lambda *a: None)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x

    bw = copy_bandwidth_gbps()
    log(f"device {torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}; "
        + (f"copy bandwidth {bw:.0f} GB/s" if bw else "no GPU: timings are interpreter wall clock, not speed"))
    gen = torch.Generator(device=dev).manual_seed(99)
    maxB, maxL = max(batches), max(contexts)
    blocks_per_row = -(-maxL // page)
    num_blocks = maxB * blocks_per_row
    # one physical cache per dtype, large enough for every row's context; rows own shuffled pages
    keys_bf16 = torch.randn(num_blocks, page, D, device=dev, generator=gen).to(torch.bfloat16)
    caches = {"bf16": keys_bf16}
    if "fp8" in prof.dtypes:
        fp8 = torch.empty(num_blocks, page, D + 4, device=dev, dtype=torch.uint8)
        write_index_key_cache(fp8, keys_bf16.view(-1, D), torch.arange(num_blocks * page, device=dev))
        caches["fp8"] = fp8
    perm = torch.randperm(num_blocks, device=dev, generator=gen).int()
    block_table_all = perm.view(maxB, blocks_per_row)

    rows, summary = [], []
    if bw:
        rows.append({"suite": SUITE, "implementation": "copy", "shape": "2GiB", "dtype": "uint8", "layout": "-",
                     "metric": "copy_bandwidth", "value": bw, "unit": "GB/s"})
    shapes = [(dt, L, B) for dt in prof.dtypes for L in contexts for B in batches]
    # what the torch baseline reads: the same keys, dequantized once (bf16)
    flats = {dt: (dequantize_index_key_cache(c, D).to(torch.bfloat16).view(-1, D) if dt == "fp8" else c.view(-1, D))
             for dt, c in caches.items()}
    for dt, L, B in tqdm(shapes, desc="indexer shapes", disable=not verbose):
        cache = caches[dt]
        key_flat = flats[dt]
        q = torch.randn(B, H, D, device=dev, generator=gen).to(torch.bfloat16)
        w = torch.randn(B, H, device=dev, generator=gen) / H
        lengths = torch.full((B,), L, device=dev, dtype=torch.int32)
        bt = block_table_all[:B, : -(-L // page)].contiguous()
        shape = f"B{B}_L{L}_H{H}_D{D}_K{K}"
        layout = f"paged{page}"
        base = {"suite": SUITE, "shape": shape, "dtype": dt, "layout": layout}

        logits_buf = torch.empty(B, L, device=dev, dtype=torch.float32)
        top_buf = torch.empty(B, K, device=dev, dtype=torch.int32)

        def logits_fn(table=bt):
            return indexer_logits_decode(q, w, cache, table, lengths, max_len=L, out=logits_buf)

        def topk_fn():
            return indexer_topk(logits_buf, K, lengths, out=top_buf)

        step_method = fastest_topk_method(L, B, cuda)      # (the op's choice; before v50 the step ran radix16)
        step_buf = torch.empty_like(top_buf)

        def step_fn(table=bt):
            logits_fn(table)
            return indexer_topk(logits_buf, K, lengths, out=step_buf, method=step_method)

        t_logits = bench(logits_fn)
        t_topk = bench(topk_fn)
        t_step = bench(step_fn)
        # the other top-k kernel and torch.topk on the same logits (torch's is the baseline's top-k)
        hist_buf, split_buf = torch.empty_like(top_buf), torch.empty_like(top_buf)
        topk_fns = {m: (lambda m=m, buf=buf: indexer_topk(logits_buf, K, lengths, out=buf, method=m))
                    for m, buf in (("hist", hist_buf), ("split", split_buf))}
        t_topk_hist = bench(topk_fns["hist"])
        t_topk_split = bench(topk_fns["split"])
        t_topk_torch = bench(lambda: torch.topk(logits_buf, min(K, L), dim=1))
        rows.append({**base, "implementation": "glm5lab-triton-hist", "metric": "topk_time",
                     "value": t_topk_hist["p50"], "unit": "us", **t_topk_hist})
        rows.append({**base, "implementation": "glm5lab-triton-split", "metric": "topk_time",
                     "value": t_topk_split["p50"], "unit": "us", **t_topk_split})
        rows.append({**base, "implementation": "torch.topk", "metric": "topk_time",
                     "value": t_topk_torch["p50"], "unit": "us", **t_topk_torch})
        hist_agrees = bool(torch.equal(hist_buf, top_buf))
        split_agrees = bool(torch.equal(split_buf, top_buf))
        nbytes = logits_bytes_read(B, L, H, D, dt)
        gbps = nbytes / (t_logits["p50"] * 1e-6) / 1e9
        impl = "glm5lab-triton"
        for metric, t in (("logits_time", t_logits), ("topk_time", t_topk), ("step_time", t_step)):
            rows.append({**base, "implementation": impl, "metric": metric, "value": t["p50"], "unit": "us", **t})
        rows.append({**base, "implementation": impl, "metric": "logits_bytes", "value": nbytes, "unit": "B"})
        rows.append({**base, "implementation": impl, "metric": "logits_bandwidth", "value": gbps, "unit": "GB/s"})
        if bw:
            rows.append({**base, "implementation": impl, "metric": "fraction_of_copy_ceiling",
                         "value": gbps / bw, "unit": "ratio"})
        graph = _graph_times(logits_fn, step_fn, topk_fns, block_table_all, B, bt.shape[1]) if cuda else {}
        for part in ("logits", "step") if graph else ():
            rows.append({**base, "implementation": impl, "metric": f"{part}_time_graph", "value": graph[part],
                         "unit": "us"})
        for name, us in graph.get("topk", {}).items():    # (under each kernel's name, beside its do_bench row)
            rows.append({**base, "implementation": f"{impl}-{name}", "metric": "topk_time_graph", "value": us,
                         "unit": "us"})
        if graph and bw:
            rows.append({**base, "implementation": impl, "metric": "fraction_of_copy_ceiling_graph",
                         "value": nbytes / (graph["logits"] * 1e-6) / 1e9 / bw, "unit": "ratio"})
        q8_rows = _e4m3_q_rows(base, q, w, cache, bt, lengths, L, block_table_all, nbytes, bw, cuda) \
            if dt == "fp8" else []
        rows += q8_rows

        t_torch = None
        if B * L <= prof.torch_max_elems:
            ref_logits, ref_top = torch_indexer_step(q, w, key_flat, bt, lengths, page, K)
            t_torch = bench(lambda: torch_indexer_step(q, w, key_flat, bt, lengths, page, K))
            rows.append({**base, "implementation": "torch", "metric": "step_time", "value": t_torch["p50"],
                         "unit": "us", **t_torch})
            # correctness on a few rows: glm5lab's set obeys the tie rule on the torch logits
            n = min(B, prof.check_rows)
            step_fn()
            scale = float(ref_logits[:n].abs().max())
            fails = topk_sets_agree(step_buf[:n], ref_logits[:n], K, lengths[:n], atol=2e-3 * scale)
            rows.append({**base, "implementation": impl, "metric": "topk_rows_valid",
                         "value": (n - len(fails)) / n, "unit": "fraction"})
            del ref_logits, ref_top
        rows.append({**base, "implementation": "glm5lab-triton-hist", "metric": "topk_equals_radix16",
                     "value": float(hist_agrees), "unit": "bool"})
        rows.append({**base, "implementation": "glm5lab-triton-split", "metric": "topk_equals_radix16",
                     "value": float(split_agrees), "unit": "bool"})
        summary.append({"dtype": dt, "context": L, "batch": B, "logits_us": t_logits["p50"],
                        "logits_q8_us": next((r["value"] for r in q8_rows if r["metric"] == "logits_time"), None),
                        "topk_us": t_topk["p50"], "topk_hist_us": t_topk_hist["p50"],
                        "topk_split_us": t_topk_split["p50"],
                        "torch_topk_us": t_topk_torch["p50"], "step_topk": step_method, "step_us": t_step["p50"],
                        "step_graph_us": graph.get("step"),
                        "torch_step_us": t_torch["p50"] if t_torch else None,
                        "speedup_vs_torch": (t_torch["p50"] / t_step["p50"]) if t_torch else None,
                        "logits_GBps": gbps, "fraction_of_copy": (gbps / bw) if bw else None})
        logits_buf = top_buf = hist_buf = split_buf = step_buf = None    # (freed; not del: the lambdas name them)
    prefill_summary = []
    for T, S in tqdm(prof.prefill if "fp8" in caches and prefill else (), desc="indexer prefill",
                     disable=not verbose):
        p_rows, p_summary = _prefill_rows(caches["fp8"], prof, T, S, gen)
        rows += p_rows
        prefill_summary.append(p_summary)
    append_rows(csv_path, rows, command=command or "glm5lab.bench.indexer_bench.run")
    df = pd.DataFrame(summary)
    log(df.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if prefill_summary:
        log(pd.DataFrame(prefill_summary).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    return df


@one_line_errors
def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m glm5lab.bench.indexer_bench", description=first_paragraph(__doc__))
    p.add_argument("--out", default="results/indexer/indexer_bench.csv")
    p.add_argument("--profile", choices=sorted(PROFILES),
                   default="gpu" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    run(args.out, args.profile, command=command_line("glm5lab.bench.indexer_bench", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
