"""Sustained load: a kernel form's time per call beside the SM clock, the board power and the energy per call.

The interleaved rounds of the kernel benchmark time short CUDA-graph replays; at the large shapes they run under
the H200's software power cap (results/kernels/NOTES.md v22 call 3: clocks 1650-1845 MHz instead of ~1980). Two
forms of one kernel can then differ by the energy each call draws as much as by their paths (NOTES.md v31's rounds
read P against the kept max up to 8% faster at one wave of programs and up to 4% slower at eight; v32's, and this
probe, faster at every size). This keeps each form busy for a block of seconds at a time -- its CUDA graph replayed
back to back, one synchronization at the block's end -- forms alternating block by block, while a second thread
reads NVML every 50 ms: time per call (the block's GPU time over its calls), SM clock, power, clock-event reasons
(bit 0x4: the software power cap), energy per call (NVML's energy counter across the block over its calls) and how
busy the GPU was (GPU time over wall time). "flashmla" times FlashMLA's fp8 sparse decode on the same inputs.
(v31 call 3 ran an earlier form that read NVML between 10-replay timings, leaving the GPU idle 40-75% of the time.)

    python -m glm5lab.bench.power_probe --out results/kernels/power_probe_h200.csv --heads 128 --tokens 512 \
        --forms ws64cps16 ws64cps16k flashmla
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time

from glm5lab.bench.records import command_line
from glm5lab.cli import first_paragraph
from glm5lab.errors import Glm5labError, one_line_errors

SUITE = "sparse_mla_power"
NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML reads this needs, through libnvidia-ml directly (no Python binding on the device image); the
    device found by the CUDA device's UUID (NVML's indices need not follow CUDA_VISIBLE_DEVICES), else index."""

    def __init__(self, index: int = 0, uuid: str | None = None):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            self._ok(self.lib.nvmlInit_v2(), "nvmlInit")
            self.handle = ctypes.c_void_p()
            if uuid:
                self._ok(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self.handle)), "device by UUID")
            else:
                self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "device handle")
            lib = self.lib
            self._reads = (lib.nvmlDeviceGetClockInfo, lib.nvmlDeviceGetPowerUsage,
                           lib.nvmlDeviceGetCurrentClocksEventReasons, lib.nvmlDeviceGetTotalEnergyConsumption)
        except (OSError, AttributeError) as exc:
            raise Glm5labError(f"NVML (libnvidia-ml.so.1) is not usable here: {exc}") from None

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise Glm5labError(f"NVML {what} failed (status {status})")

    def read(self) -> dict:
        """SM clock (MHz), power (W), clock-event reasons (bit mask), energy since the driver loaded (mJ)."""
        clock_of, power_of, reasons_of, energy_of = self._reads
        clock, power = ctypes.c_uint(), ctypes.c_uint()
        reasons, energy = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        self._ok(clock_of(self.handle, NVML_CLOCK_SM, ctypes.byref(clock)), "SM clock")
        self._ok(power_of(self.handle, ctypes.byref(power)), "power")
        self._ok(reasons_of(self.handle, ctypes.byref(reasons)), "reasons")
        self._ok(energy_of(self.handle, ctypes.byref(energy)), "energy")
        return {"clock": float(clock.value), "power": power.value / 1e3, "reasons": int(reasons.value),
                "energy_mj": float(energy.value)}

    def close(self) -> None:
        self.lib.nvmlShutdown()


def block_stats(gpu_ms: float, calls: int, wall_s: float, reads: list, first: dict, last: dict) -> dict:
    """One block of back-to-back replays: the GPU time a call, the median clock and power of the sampler's reads,
    the share of them with the power cap's reason (0x4) set, the energy per call (uJ: NVML's counter from just
    before the block to just after its end, over its calls) and the GPU's busy fraction (GPU time over wall time)."""
    reads = reads or [first, last]
    return {"time_us": gpu_ms * 1e3 / calls, "sm_clock_mhz": statistics.median(r["clock"] for r in reads),
            "power_w": statistics.median(r["power"] for r in reads),
            "power_capped": sum(bool(r["reasons"] & 0x4) for r in reads) / len(reads),
            "energy_uj_per_call": (last["energy_mj"] - first["energy_mj"]) * 1e3 / calls,
            "busy": gpu_ms / 1e3 / wall_s}


def sustained_block(graph, calls_a_replay: int, seconds: float, nvml: Nvml, every_s: float = 0.05) -> dict:
    """`graph` replayed back to back for `seconds` (launches queued, one synchronization at the end) while a
    thread reads NVML every `every_s`; `block_stats` of it."""
    import torch

    reads, stop = [], threading.Event()

    def sample():
        while not stop.wait(every_s):
            reads.append(nvml.read())

    torch.cuda.synchronize()
    first = nvml.read()
    t0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start.record()
    replays = 0
    while time.perf_counter() - t0 < seconds:
        graph.replay()
        replays += 1
    end.record()
    end.synchronize()
    wall_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
    return block_stats(start.elapsed_time(end), replays * calls_a_replay, wall_s, reads, first, nvml.read())


def sustained_samples(graphs: dict, calls_a_replay: int, rounds: int, seconds: float, nvml: Nvml) -> dict:
    """{form: [`sustained_block` a round]}: every form's graph kept busy `seconds` a block, forms alternating, the
    order rotated by one place a round (as `timing.interleaved_samples`)."""
    forms = list(graphs)
    samples = {f: [] for f in forms}
    for r in range(rounds):
        for j in range(len(forms)):
            form = forms[(r + j) % len(forms)]
            samples[form].append(sustained_block(graphs[form], calls_a_replay, seconds, nvml))
    return samples


def current_device_nvml() -> Nvml:
    """NVML of the current CUDA device (found by its UUID where torch gives one)."""
    import torch

    dev = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    return Nvml(dev, f"GPU-{uuid}" if uuid is not None else None)


def random_fp8_cache(num_slots: int, gen):
    """A random fp8_ds_mla cache of num_slots rows (the probes' inputs, seeded by `gen`)."""
    import torch

    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla

    return quantize_fp8_ds_mla(torch.randn(num_slots // 64, 64, 576, device="cuda", generator=gen).to(torch.bfloat16))


def rows_of(samples: dict, shape: str) -> list:
    """Long-format rows ({form: [block_stats a block]} -> one row a form and metric, p20 / p50 / p80 over blocks)."""
    from glm5lab.bench.timing import quantiles

    units = {"time_us": "us", "sm_clock_mhz": "MHz", "power_w": "W", "power_capped": "fraction",
             "energy_uj_per_call": "uJ", "busy": "fraction"}
    rows = []
    for form, blocks in samples.items():
        for metric, unit in units.items():
            q = quantiles([b[metric] for b in blocks])
            rows.append({"suite": SUITE, "implementation": form, "shape": shape, "dtype": "bf16",
                         "layout": "fp8_ds_mla", "metric": metric, "value": q["p50"], "unit": unit, **q})
    return rows


def run(out_csv: str, heads=(128,), tokens=(512,), forms=("ws64cps16", "ws64cps16k"), seconds: float = 1.0,
        rounds: int = 4, topk: int = 2048, num_slots: int = 524288, command: str = "") -> list:
    """Each (heads, tokens) shape: every form in `forms` (names of kernel_bench.GLUON_VARIANTS, "glm5lab" for the
    default, or "flashmla" for FlashMLA's fp8 sparse decode on the same inputs) kept busy `seconds` a block, forms
    alternating, `rounds` blocks each; rows appended to out_csv."""
    import torch

    from glm5lab.bench.kernel_bench import GLUON_VARIANTS, capture_graph, input_sets, rotating_sets
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import need_gpu
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    known = dict(GLUON_VARIANTS)
    unknown = [f for f in forms if f not in ("glm5lab", "flashmla") and f not in known]
    if unknown:
        raise Glm5labError(f"unknown form(s) {unknown}; expected 'glm5lab', 'flashmla' or names from {list(known)}")
    need_gpu("the power probe")
    if "flashmla" in forms:
        from glm5lab.bench import flashmla_anchor
        flashmla_anchor.load()
    nvml = current_device_nvml()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    cache = random_fp8_cache(num_slots, gen)
    scale = mla_softmax_scale()
    all_rows = []
    try:
        for H in heads:
            for T in tokens:
                sets = input_sets(T, H, topk, num_slots, rotating_sets(T, topk), gen)
                graphs = {}
                for form in forms:
                    if form == "flashmla":
                        graphs[form] = capture_graph([flashmla_anchor.SparseDecodeFP8(q, cache, s, scale)
                                                      for q, s in sets])
                        continue
                    cfg = None if form == "glm5lab" else {**known[form], "impl": "gluon"}
                    graphs[form] = capture_graph([lambda q=q, s=s, cfg=cfg: sparse_mla_attention(q, cache, s, scale,
                                                                                                 _config=cfg)
                                                  for q, s in sets])
                samples = sustained_samples(graphs, len(sets), rounds, seconds, nvml)
                rows = rows_of(samples, f"H{H}_T{T}_K{topk}")
                append_rows(out_csv, rows, command=command)
                all_rows += rows
                for form in forms:
                    blk = samples[form]
                    print(f"H{H} T{T} {form:>14}: " + "  ".join(
                        f"{k} {statistics.median(b[k] for b in blk):.4g}" for k in blk[0]), flush=True)
    finally:
        nvml.close()
    return all_rows


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5lab.bench.power_probe", description=first_paragraph(__doc__))
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, nargs="+", default=[128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--forms", nargs="+", default=["ws64cps16", "ws64cps16k"])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    run(args.out, args.heads, args.tokens, tuple(args.forms), args.seconds, args.rounds,
        command=command_line("glm5lab.bench.power_probe", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
