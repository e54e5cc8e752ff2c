"""Sustained load: a kernel form's time per call beside the SM clock, the board power and the energy per call.

The interleaved rounds of the kernel benchmark time short CUDA-graph replays; at the large shapes they run under
the H200's software power cap (results/kernels/NOTES.md v22 call 3: clocks 1650-1845 MHz instead of ~1980). Two
forms of one kernel can then differ by the energy each call draws as much as by their paths: NOTES.md v31 found P
against the kept max up to 8% faster at one wave of programs and up to 5% slower at eight. This keeps each form
busy for a block of seconds at a time, forms alternating block by block, and reads NVML around every timing: time
per call, SM clock, power, clock-event reasons (bit 0x4: the software power cap) and energy per call (NVML's
energy counter over the block / the calls in it).

    python -m glm5lab.bench.power_probe --out results/kernels/power_probe_h200.csv --heads 128 --tokens 512 \
        --forms ws64cps16 ws64cps16k
"""
from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time

from glm5lab.errors import Glm5labError, one_line_errors

SUITE = "sparse_mla_power"
NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML reads this needs, through libnvidia-ml directly (no Python binding on the device image)."""

    def __init__(self, index: int = 0):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            raise Glm5labError(f"NVML (libnvidia-ml.so.1) is not loadable here: {exc}") from None
        self._ok(self.lib.nvmlInit_v2(), "nvmlInit")
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "device handle")

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise Glm5labError(f"NVML {what} failed (status {status})")

    def read(self) -> dict:
        """SM clock (MHz), power (W), clock-event reasons (bit mask), energy since the driver loaded (mJ)."""
        clock, power = ctypes.c_uint(), ctypes.c_uint()
        reasons, energy = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(clock)), "SM clock")
        self._ok(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(power)), "power")
        self._ok(self.lib.nvmlDeviceGetCurrentClocksEventReasons(self.handle, ctypes.byref(reasons)), "reasons")
        self._ok(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(energy)), "energy")
        return {"clock": float(clock.value), "power": power.value / 1e3, "reasons": int(reasons.value),
                "energy_mj": float(energy.value)}


def block_stats(timings_us: list, reads: list, calls: int) -> dict:
    """One block of sustained replays: the median time a call, the median clock and power of the reads taken
    between timings, the share of reads with the power cap's reason (0x4) set, and the energy per call (uJ) from the
    first to the last read."""
    import statistics

    energy = (reads[-1]["energy_mj"] - reads[0]["energy_mj"]) * 1e3 / max(calls, 1)
    return {"time_us": statistics.median(timings_us), "sm_clock_mhz": statistics.median(r["clock"] for r in reads),
            "power_w": statistics.median(r["power"] for r in reads),
            "power_capped": sum(bool(r["reasons"] & 0x4) for r in reads) / len(reads), "energy_uj_per_call": energy}


def rows_of(samples: dict, shape: str) -> list:
    """Long-format rows ({form: [block_stats a block]} -> one row a form and metric, p20 / p50 / p80 over blocks)."""
    from glm5lab.bench.timing import quantiles

    units = {"time_us": "us", "sm_clock_mhz": "MHz", "power_w": "W", "power_capped": "fraction",
             "energy_uj_per_call": "uJ"}
    rows = []
    for form, blocks in samples.items():
        for metric, unit in units.items():
            q = quantiles([b[metric] for b in blocks])
            rows.append({"suite": SUITE, "implementation": form, "shape": shape, "dtype": "bf16",
                         "layout": "fp8_ds_mla", "metric": metric, "value": q["p50"], "unit": unit, **q})
    return rows


def run(out_csv: str, heads=(128,), tokens=(512,), forms=("ws64cps16", "ws64cps16k"), seconds: float = 1.0,
        rounds: int = 4, topk: int = 2048, num_slots: int = 524288, command: str = "") -> list:
    """Each (heads, tokens) shape: every form in `forms` (names of kernel_bench.GLUON_VARIANTS, or "glm5lab" for the
    default) kept busy `seconds` a block, forms alternating, `rounds` blocks each; rows appended to out_csv."""
    import torch

    from glm5lab.bench.kernel_bench import GLUON_VARIANTS, graph_timer
    from glm5lab.bench.records import append_rows
    from glm5lab.bench.timing import need_gpu
    from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla
    from glm5lab.kernels.sparse_mla import sparse_mla_attention
    from glm5lab.sparse.reference import mla_softmax_scale

    need_gpu("the power probe")
    known = dict(GLUON_VARIANTS)
    unknown = [f for f in forms if f != "glm5lab" and f not in known]
    if unknown:
        raise Glm5labError(f"unknown form(s) {unknown}; expected 'glm5lab' or names from {list(known)}")
    nvml = Nvml(torch.cuda.current_device())
    gen = torch.Generator(device="cuda").manual_seed(1234)
    cache = quantize_fp8_ds_mla(torch.randn(num_slots // 64, 64, 576, device="cuda", generator=gen).to(torch.bfloat16))
    scale = mla_softmax_scale()
    all_rows = []
    for H in heads:
        for T in tokens:
            n_sets = max(1, min(32, math.ceil(150e6 / (T * topk * 656))))
            sets = [(torch.randn(T, H, 576, device="cuda", generator=gen).to(torch.bfloat16),
                     torch.randint(0, num_slots, (T, topk), device="cuda", dtype=torch.int32, generator=gen))
                    for _ in range(n_sets)]
            timers = {}
            for form in forms:
                cfg = None if form == "glm5lab" else {**known[form], "impl": "gluon"}
                calls = [lambda q=q, s=s, cfg=cfg: sparse_mla_attention(q, cache, s, scale, _config=cfg)
                         for q, s in sets]
                timers[form] = (graph_timer(calls, replays=10), 10 * len(calls))
            samples = {f: [] for f in forms}
            for r in range(rounds):
                for j in range(len(forms)):
                    form = forms[(r + j) % len(forms)]
                    timer, calls_a_timing = timers[form]
                    reads, timings = [nvml.read()], []
                    t_end = time.perf_counter() + seconds
                    while time.perf_counter() < t_end:
                        timings.append(timer())
                        reads.append(nvml.read())
                    samples[form].append(block_stats(timings, reads, calls_a_timing * len(timings)))
            rows = rows_of(samples, f"H{H}_T{T}_K{topk}")
            append_rows(out_csv, rows, command=command)
            all_rows += rows
            for form in forms:
                blk = samples[form]
                print(f"H{H} T{T} {form:>14}: " + "  ".join(
                    f"{k} {sorted(b[k] for b in blk)[len(blk) // 2]:.4g}" for k in blk[0]), flush=True)
    return all_rows


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, nargs="+", default=[128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--forms", nargs="+", default=["ws64cps16", "ws64cps16k"])
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    run(args.out, args.heads, args.tokens, tuple(args.forms), args.seconds, args.rounds,
        command=" ".join(["python -m glm5lab.bench.power_probe", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
