"""Tensor-parallel decode steps of the GLM-5 attention stack: what the all-reduce costs, measured.

Why: GLM-5 is served with TP over 8 GPUs. Each GPU then holds 64/TP attention heads (q_b, W_uk, W_uv and
its columns of o_proj), but the whole MLA latent KV cache, the index-key cache, q_a/kv_a and the DSA
indexer (they have no head axis to split; vLLM replicates them too). Every layer ends its attention
block with an all-reduce of the partial o_proj outputs [B, 6144] and its MoE block with another one of
the same size. The notebook-06 projection assumes a cost for those; this module measures it.

One layer step per rank (`TPLayer.step`), the layer of glm5lab.bench.attention_stack sliced by heads:
    projections -> indexer top-k -> sparse MLA attention (glm5lab kernel, or the torch reference)
    -> W_uv, o_proj on this rank's heads -> all-reduce #1 (real: the partial o_proj sums)
    -> all-reduce #2: MoE STAND-IN, a zero [B, 6144] bf16 buffer; the MoE compute itself is NOT in the
       step (nothing of the MoE is modeled but its all-reduce, which has the same size as #1).
Per batch size it measures, on every rank, back-to-back steps (no host sync between them, as a decode
loop runs): the step time, the time inside the two all-reduces (device events around each call, so it is
a part of the step and the share lies in [0, 1]; it includes waiting for the slowest rank, a real TP
cost), one all-reduce of the same size timed alone, and on rank 0 alone the same layer with all 64 heads
and no communication (the 1-GPU run of the same shapes, for the speed-up ratio). Eager launches, no CUDA
graphs: at batch 1 the host launch overhead is in both the TP and the 1-GPU step.

`tp` may exceed the world size (world 1, tp 8 = one GPU running one TP8 slice; the all-reduce then spans
only the processes that exist). The correctness check sums every slice (each rank its share, then the
all-reduce) and compares with the unsharded layer, whatever tp/world is.

Rows (glm5lab.bench.records.append_rows): suite "tp_attention_stack", shape "H{heads per GPU}_B_L",
layout "{machine}:tp{tp}:world{world}" (the 1-GPU baseline: "{machine}:tp1:world1").
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from glm5lab.bench.attention_stack import GLM5_LAYERS, PROFILES as STACK_PROFILES, AttentionLayer, StackShape
from glm5lab.errors import Glm5labError, one_line_errors
from glm5lab.files import make_folder

SUITE = "tp_attention_stack"
# NVLink multicast stays off (device machine rule): set in every process this module starts.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Profile:
    shape_kw: dict
    heads: int
    batches: tuple
    contexts: tuple
    warmup: int
    reps: int
    budget_s: float


PROFILES = {
    # real widths; batches in priority order (the budget stops the sweep, skipped shapes get a row)
    "gpu": Profile({}, 64, (1, 32, 256, 8, 128, 64), (4096,), warmup=5, reps=30, budget_s=40.0),
    # tiny widths for CPU/gloo tests: the attention-stack CPU shapes (interpreter-friendly)
    "cpu": Profile(dict(STACK_PROFILES["cpu"].shape_kw), 4, (2,), (48,), warmup=1, reps=2, budget_s=120.0),
}


@dataclass
class RunConfig:
    world_size: int
    backend: str = "nccl"
    profile: str = "gpu"
    tp: int | None = None                  # heads are split tp ways; default = world_size
    impl: str = "glm5lab"                   # "glm5lab" (Triton indexer + fused kernel) or "torch"
    batches: tuple = ()
    contexts: tuple = ()
    warmup: int | None = None
    reps: int | None = None
    budget_s: float | None = None
    baseline: bool = True                  # rank 0 also times the unsharded layer (1 GPU, all heads)
    check: bool = True                     # sharded (summed over all slices) == unsharded
    machine: str | None = None
    out: str = "results/tp/tp_attention_stack.csv"
    command: str = ""
    seed: int = 0

    def resolved(self) -> "RunConfig":
        p = PROFILES[self.profile]
        return RunConfig(**{**asdict(self), "tp": self.tp or self.world_size,
                            "batches": tuple(self.batches or p.batches), "contexts": tuple(self.contexts or p.contexts),
                            "warmup": p.warmup if self.warmup is None else self.warmup,
                            "reps": p.reps if self.reps is None else self.reps,
                            "budget_s": p.budget_s if self.budget_s is None else self.budget_s,
                            "machine": self.machine or machine_kind(self.backend, self.world_size)})


def machine_kind(backend: str, world: int) -> str:
    """'nvidia-h200', 'nvidia-h200-x8' (the device tool's names) or '<gpu name>-x<n>' / 'cpu-gloo'."""
    if backend == "gloo" or not torch.cuda.is_available():
        return "cpu-gloo"
    name = torch.cuda.get_device_name(0)
    n = torch.cuda.device_count()
    base = "nvidia-h200" if "H200" in name else name.lower().replace(" ", "-")
    return base if n == 1 else f"{base}-x{n}"


def validate(cfg: RunConfig) -> RunConfig:
    """Bad combinations are user errors (one line), found before any process starts."""
    if cfg.profile not in PROFILES:
        raise Glm5labError(f"unknown profile {cfg.profile!r} (choose {sorted(PROFILES)})")
    cfg = cfg.resolved()
    if cfg.backend not in ("nccl", "gloo"):
        raise Glm5labError(f"backend must be nccl or gloo, not {cfg.backend!r}")
    if cfg.impl not in ("glm5lab", "torch"):
        raise Glm5labError(f"implementation must be glm5lab or torch, not {cfg.impl!r}")
    if cfg.world_size < 1:
        raise Glm5labError(f"world size must be >= 1, got {cfg.world_size}")
    heads = PROFILES[cfg.profile].heads
    if cfg.tp < 1 or heads % cfg.tp or cfg.tp % cfg.world_size:
        raise Glm5labError(f"tp={cfg.tp} must divide the {heads} heads and be a multiple of the world size "
                           f"{cfg.world_size}")
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise Glm5labError("backend nccl needs CUDA GPUs; use --backend gloo on a CPU machine")
        if torch.cuda.device_count() < cfg.world_size:
            raise Glm5labError(f"world size {cfg.world_size} > {torch.cuda.device_count()} visible GPUs")
    if min(cfg.batches) < 1 or min(cfg.contexts) < 1 or cfg.reps < 1:
        raise Glm5labError("batches, contexts and reps must be >= 1")
    return cfg


# ------------------------------------------------------------------------------------ the sharded layer
def shard_heads(full: AttentionLayer, index: int, tp: int) -> AttentionLayer:
    """Slice `index` of `tp` of a full layer: its heads' q_b rows, W_uk, W_uv and o_proj columns; every
    other tensor (caches, q_a, kv_a, indexer, inputs) is the full layer's own object (replicated)."""
    s, H = full.s, full.H
    if H % tp or not 0 <= index < tp:
        raise Glm5labError(f"cannot take slice {index} of {tp} from {H} heads")
    h = H // tp
    sl = slice(index * h, (index + 1) * h)
    part = copy.copy(full)
    part.H = h
    part.w_qb = full.w_qb.view(H, s.nope + s.rope, s.q_lora)[sl].reshape(h * (s.nope + s.rope), s.q_lora).contiguous()
    part.w_uk = full.w_uk[sl].contiguous()
    part.w_uv = full.w_uv[sl].contiguous()
    part.w_o = full.w_o.view(s.hidden, H, s.v_head)[:, sl].reshape(s.hidden, h * s.v_head).contiguous()
    return part


def partial_output(layer: AttentionLayer, impl: str) -> torch.Tensor:
    """This slice's o_proj partial sum [B, hidden] (before the all-reduce)."""
    return layer.step(impl)


class Clock:
    """Timestamps on the device stream (CUDA events) or the host (perf_counter, CPU/gloo is synchronous)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6


def _pcts(xs: list[float]) -> dict:
    xs = sorted(xs)
    if len(xs) == 1:
        return {"p20": xs[0], "p50": xs[0], "p80": xs[0]}
    q = statistics.quantiles(xs, n=5, method="inclusive")
    return {"p20": q[0], "p50": statistics.median(xs), "p80": q[3]}


def _barrier() -> None:
    """dist.barrier on this rank's GPU (NCCL otherwise guesses the device and warns)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def time_tp_steps(layer: AttentionLayer, impl: str, moe_buf: torch.Tensor, clock: Clock, warmup: int,
                  reps: int, collectives: bool = True) -> dict[str, list[float]]:
    """Per-rep lists (us): step, attention all-reduce, MoE stand-in all-reduce, and their sum."""
    def one(marks):
        out = partial_output(layer, impl)
        if collectives:
            a = clock.mark()
            dist.all_reduce(out)
            b = clock.mark()
            dist.all_reduce(moe_buf)
            c = clock.mark()
            marks.append((a, b, c))
        return out

    for _ in range(warmup):
        one([])
    clock.sync()
    if collectives:
        _barrier()
    starts, ends, marks = [], [], []
    for _ in range(reps):
        starts.append(clock.mark())
        one(marks)
        ends.append(clock.mark())
    clock.sync()
    step = [clock.us(s, e) for s, e in zip(starts, ends)]
    res = {"step": step}
    if collectives:
        res["attn_ar"] = [clock.us(a, b) for a, b, _ in marks]
        res["moe_ar"] = [clock.us(b, c) for _, b, c in marks]
        res["ar"] = [x + y for x, y in zip(res["attn_ar"], res["moe_ar"])]
    return res


def time_isolated_allreduce(buf: torch.Tensor, clock: Clock, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        dist.all_reduce(buf)
    clock.sync()
    _barrier()
    marks = [clock.mark()]
    for _ in range(reps):
        dist.all_reduce(buf)
        marks.append(clock.mark())
    clock.sync()
    return [clock.us(a, b) for a, b in zip(marks, marks[1:])]


def check_sharded(full: AttentionLayer, cfg: RunConfig, rank: int, impl: str) -> tuple[float, float]:
    """(max |sharded - unsharded|, that over max |unsharded|): each rank sums its slices r, r+world, ...,
    the all-reduce sums the ranks, so every slice of the tp-way split is in the result exactly once."""
    acc = None
    for index in range(rank, cfg.tp, cfg.world_size):
        part = partial_output(shard_heads(full, index, cfg.tp), impl).float()
        acc = part if acc is None else acc + part
    dist.all_reduce(acc)
    ref = partial_output(full, impl).float()
    err = (acc - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-30)


# ------------------------------------------------------------------------------------ one process
def _agg(per_rank: list[dict], key: str, how=max) -> dict:
    """Aggregate per-rank percentile dicts: `how` of each percentile over ranks."""
    return {k: how(r[key][k] for r in per_rank) for k in ("p20", "p50", "p80")}


def worker(rank: int, cfg: RunConfig, init_file: str, rows_file: str) -> None:
    """One rank: init the process group, sweep the shapes; rank 0 appends each shape's rows as soon as
    they exist (a later failure loses only the shape it happened in)."""
    os.environ.update(MULTICAST_OFF_ENV)
    cuda = cfg.backend == "nccl"
    threads = torch.get_num_threads()
    if cuda:
        torch.cuda.set_device(rank)
    else:   # ranks share the host's cores; at tiny widths intra-op threads only add sync cost (10-50x here)
        torch.set_num_threads(1 if cfg.profile == "cpu" else max(1, (os.cpu_count() or 1) // cfg.world_size))
    device = f"cuda:{rank}" if cuda else "cpu"
    dist.init_process_group(cfg.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=cfg.world_size, timeout=timedelta(seconds=300))
    try:
        from glm5lab.bench.records import append_rows

        every: list[dict] = []
        for rows in _sweep(rank, cfg, device, Clock(cuda)):
            if rank == 0 and rows:
                append_rows(cfg.out, rows, command=cfg.command)
                every += rows
                Path(rows_file).write_text(json.dumps(every))
        _barrier()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)       # world 1 runs in the caller's process: leave it as it was


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sweep(rank: int, cfg: RunConfig, device: str, clock: Clock):
    """Yields each shape's rows (rank 0; the other ranks yield empty lists)."""
    prof = PROFILES[cfg.profile]
    s = StackShape(**prof.shape_kw)
    H, tp, world = prof.heads, cfg.tp, cfg.world_size
    h = H // tp
    tp_layout = f"{cfg.machine}:tp{tp}:world{world}"
    t0 = time.time()
    _log(rank, f"[tp] {cfg.machine} world {world} tp {tp} ({h} of {H} heads per process) backend {cfg.backend} "
               f"impl {cfg.impl} profile {cfg.profile}: batches {cfg.batches} contexts {cfg.contexts}")
    with torch.no_grad():
        for L in cfg.contexts:
            for B in cfg.batches:
                shape = f"H{h}_B{B}_L{L}"
                base = {"suite": SUITE, "implementation": cfg.impl, "shape": shape, "dtype": "bf16",
                        "layout": tp_layout}
                go = [time.time() - t0 <= cfg.budget_s]
                dist.broadcast_object_list(go, src=0)
                if not go[0]:
                    _log(rank, f"  {shape}: skipped (budget {cfg.budget_s:.0f} s spent)")
                    yield [{**base, "metric": "skipped", "value": float("nan"), "unit": "time budget spent"}]
                    continue
                err = None
                try:
                    full = AttentionLayer(s, H, B, L, device, seed=cfg.seed)
                    mine = shard_heads(full, rank, tp)
                    moe_buf = torch.zeros(B, s.hidden, device=device, dtype=torch.bfloat16)
                    partial_output(mine, cfg.impl)          # compile / first touch before agreeing
                except Exception as exc:  # noqa: BLE001  (e.g. out of memory at the largest shapes)
                    err = f"{type(exc).__name__}: {str(exc)[:250]}"
                errs = [None] * world
                dist.all_gather_object(errs, err)
                bad = [e for e in errs if e]
                if bad:
                    _log(rank, f"  {shape}: setup FAILED on {len(bad)} rank(s): {bad[0]}")
                    full = mine = moe_buf = None
                    _free(device)
                    yield [{**base, "metric": "failed", "value": float("nan"), "unit": bad[0]}]
                    continue
                try:
                    rows = _measure_shape(rank, cfg, clock, full, mine, moe_buf, base, B, H, L)
                except Exception as exc:  # noqa: BLE001
                    if world > 1:
                        raise     # peers may be inside a collective: fail the whole run (mp.spawn stops them)
                    _log(rank, f"  {shape}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    rows = [{**base, "metric": "failed", "value": float("nan"),
                             "unit": f"{type(exc).__name__}: {str(exc)[:250]}"}]
                full = mine = moe_buf = None
                _free(device)
                yield rows if rank == 0 else []


def _measure_shape(rank: int, cfg: RunConfig, clock: Clock, full: AttentionLayer, mine: AttentionLayer,
                   moe_buf: torch.Tensor, base: dict, B: int, H: int, L: int) -> list[dict]:
    """Check, 1-GPU baseline (rank 0), TP steps, isolated all-reduce; rank 0 gets the rows."""
    rows = []
    if cfg.check:
        abs_err, rel_err = check_sharded(full, cfg, rank, cfg.impl)
        rows += [{**base, "metric": "max_abs_err_vs_unsharded", "value": abs_err, "unit": "abs"},
                 {**base, "metric": "max_rel_err_vs_unsharded", "value": rel_err,
                  "unit": "fraction of max |unsharded|"}]
    one = None                       # 1 GPU, all heads, no communication: rank 0 alone, the others wait
    if cfg.baseline:
        if rank == 0:
            one = time_tp_steps(full, cfg.impl, moe_buf, clock, cfg.warmup, cfg.reps, collectives=False)
        _barrier()
    r = time_tp_steps(mine, cfg.impl, moe_buf, clock, cfg.warmup, cfg.reps)
    iso = time_isolated_allreduce(moe_buf, clock, cfg.warmup, cfg.reps)
    mine_stats = {"step": _pcts(r["step"]), "ar": _pcts(r["ar"]), "attn_ar": _pcts(r["attn_ar"]),
                  "moe_ar": _pcts(r["moe_ar"]), "compute": _pcts([a - b for a, b in zip(r["step"], r["ar"])]),
                  "share": _pcts([a / b for a, b in zip(r["ar"], r["step"])]), "iso": _pcts(iso)}
    per_rank = [None] * cfg.world_size
    dist.all_gather_object(per_rank, mine_stats)
    if rank != 0:
        return []
    rows += _rows(base, per_rank, one, B, H, L, cfg, f"{cfg.machine}:tp1:world1")
    step = max(p["step"]["p50"] for p in per_rank)
    share = statistics.median(p["share"]["p50"] for p in per_rank)
    msg = (f"  {base['shape']:16s} step {step:9.1f} us  all-reduce share {share:5.1%}  "
           f"isolated all-reduce {max(p['iso']['p50'] for p in per_rank):7.1f} us")
    if one is not None:
        msg += f"  | 1 GPU H{H}: {statistics.median(one['step']):9.1f} us"
    _log(rank, msg)
    return rows


def _rows(base: dict, per_rank: list[dict], one: dict | None, B: int, H: int, L: int, cfg: RunConfig,
          one_layout: str) -> list[dict]:
    step = _agg(per_rank, "step")                       # the slowest rank sets the pace
    rows = [{**base, "metric": "step_time", "value": step["p50"], "unit": "us", **step}]
    for key, metric in (("ar", "allreduce_time"), ("attn_ar", "attn_allreduce_time"),
                        ("moe_ar", "moe_standin_allreduce_time"), ("compute", "compute_time"),
                        ("iso", "allreduce_isolated_time")):
        agg = _agg(per_rank, key)
        rows.append({**base, "metric": metric, "value": agg["p50"], "unit": "us", **agg})
    share = _agg(per_rank, "share", how=lambda xs: statistics.median(list(xs)))
    rows.append({**base, "metric": "allreduce_share", "value": share["p50"], "unit": "fraction of step", **share})
    rows += [{**base, "metric": "layer_tokens_per_s", "value": B / (step["p50"] * 1e-6), "unit": "tok/s"},
             {**base, "metric": "stack78_tokens_per_s", "value": B / (GLM5_LAYERS * step["p50"] * 1e-6),
              "unit": "tok/s (78 attention layers, no MoE compute)"},
             {**base, "metric": "allreduce_bytes", "value": B * StackShape(**PROFILES[cfg.profile].shape_kw).hidden * 2,
              "unit": "bytes per call"}]
    if one is not None:
        o = _pcts(one["step"])
        ob = {**base, "shape": f"H{H}_B{B}_L{L}", "layout": one_layout}
        rows += [{**ob, "metric": "step_time", "value": o["p50"], "unit": "us", **o},
                 {**ob, "metric": "layer_tokens_per_s", "value": B / (o["p50"] * 1e-6), "unit": "tok/s"},
                 {**ob, "metric": "stack78_tokens_per_s", "value": B / (GLM5_LAYERS * o["p50"] * 1e-6),
                  "unit": "tok/s (78 attention layers, no MoE compute)"},
                 {**base, "metric": "speedup_vs_1gpu", "value": o["p50"] / step["p50"],
                  "unit": f"1-GPU step / TP step ({one_layout} vs this layout)"}]
    return rows


# ------------------------------------------------------------------------------------ launcher
def run(cfg: RunConfig) -> list[dict]:
    """Start world_size processes (torch.multiprocessing, one per GPU) or run in this process for world
    size 1; return rank 0's rows (also appended to cfg.out)."""
    cfg = validate(cfg)
    os.environ.update(MULTICAST_OFF_ENV)
    if cfg.backend == "gloo" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")   # the Triton kernels run in the interpreter on CPU
    make_folder(Path(cfg.out).parent)
    with tempfile.TemporaryDirectory(prefix="glm5lab-tp-") as tmp:
        init_file, rows_file = os.path.join(tmp, "store"), os.path.join(tmp, "rows.json")
        if cfg.world_size == 1:
            worker(0, cfg, init_file, rows_file)
        else:
            import torch.multiprocessing as mp

            mp.spawn(worker, args=(cfg, init_file, rows_file), nprocs=cfg.world_size, join=True)
        return json.loads(Path(rows_file).read_text()) if os.path.exists(rows_file) else []


def _ints(text: str) -> tuple:
    return tuple(int(x) for x in text.replace(",", " ").split())


@one_line_errors
def main(argv=None) -> int:
    import argparse

    default_world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    p = argparse.ArgumentParser(
        prog="tp_attention_stack.py",
        description="Tensor-parallel decode steps of the GLM-5 attention stack (one process per GPU): step "
                    "time, all-reduce share, tokens/s per batch size, and the same shapes on 1 GPU.")
    p.add_argument("--world-size", type=int, default=default_world,
                   help=f"processes (GPUs); default: visible GPUs ({default_world})")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--tp", type=int, default=None,
                   help="split the heads this many ways (default: world size; world 1 + tp 8 = one TP8 slice)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="gpu" if torch.cuda.is_available() else "cpu",
                   help="gpu: GLM-5 widths (hidden 6144, 64 heads); cpu: tiny widths for tests")
    p.add_argument("--impl", choices=("glm5lab", "torch"), default="glm5lab")
    p.add_argument("--batches", type=_ints, default=(), help="e.g. '1 8 32 256' (default: the profile's)")
    p.add_argument("--contexts", type=_ints, default=(), help="e.g. '4096 65536' (default: the profile's)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of sweeping before skipping shapes")
    p.add_argument("--no-baseline", action="store_true", help="skip the 1-GPU all-heads step")
    p.add_argument("--no-check", action="store_true", help="skip the sharded == unsharded check")
    p.add_argument("--machine", default=None, help="machine kind for the rows (default: detected)")
    p.add_argument("--out", default="results/tp/tp_attention_stack.csv",
                   help="CSV to append to (a folder means <folder>/tp_attention_stack.csv)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.suffix != ".csv":
        out = out / "tp_attention_stack.csv"
    cfg = RunConfig(world_size=a.world_size, backend=a.backend, profile=a.profile, tp=a.tp, impl=a.impl,
                    batches=a.batches, contexts=a.contexts, warmup=a.warmup, reps=a.reps, budget_s=a.budget,
                    baseline=not a.no_baseline, check=not a.no_check, machine=a.machine, out=str(out),
                    command=" ".join(["tp_attention_stack.py", *(argv if argv is not None else sys.argv[1:])]))
    t0 = time.time()
    rows = run(cfg)
    bad = [r for r in rows if r["metric"] == "failed"]
    print(f"[tp] {len(rows)} rows -> {out} in {time.time() - t0:.1f} s" + (f"; {len(bad)} shape(s) failed" if bad else ""))
    return 3 if bad or not rows else 0
