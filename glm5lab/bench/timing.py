"""Timing with device events: median and 20th/80th percentiles of many launches after warm-up.

On the GPU this is `triton.testing.do_bench` (CUDA events, L2 flushed between runs). On the CPU (the
interpreter) it is wall-clock around a synchronous call: those numbers exercise the code path and are
never reported as performance.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable


def need_gpu(what: str) -> None:
    """A clear error, before any work, for a tool whose numbers only mean something on a GPU."""
    import torch

    from glm5lab.errors import Glm5labError

    if not torch.cuda.is_available():
        raise Glm5labError(f"{what} times kernels on the GPU: it needs a GPU")


def bench(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100,
          cpu_reps: int = 3) -> dict:
    """Return {'p20','p50','p80'} in microseconds."""
    import torch

    if torch.cuda.is_available():
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        p20, p50, p80 = (1e3 * x for x in q)
        return {"p20": p20, "p50": p50, "p80": p80}
    fn()  # warm-up (compiles / traces)
    times = []
    for _ in range(max(1, cpu_reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return quantiles(times)


def quantiles(xs: list) -> dict:
    """{'p20','p50','p80'} of a list of timings."""
    q = statistics.quantiles(xs, n=5) if len(xs) >= 2 else [xs[0]] * 4
    return {"p20": q[0], "p50": statistics.median(xs), "p80": q[3]}


def interleaved_samples(timers: dict, rounds: int = 15) -> dict:
    """{name: [one timing a round]} of `timers` ({name: a no-argument call returning one timing}) taken in rounds:
    each round calls every timer once, in an order rotated by one place a round, so no implementation always runs
    first or after the same neighbour. Why: timed one after another, two identical kernels in one run differed by up
    to 6% on the H200 (results/kernels/NOTES.md v16-v17) -- a drift or a position effect that rounds spread over every
    implementation alike. The k-th timing of every name comes from the same round, so ratios can be taken round by
    round (`paired_quantiles`)."""
    names = list(timers)
    samples = {n: [] for n in names}
    for r in range(max(1, rounds)):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            samples[name].append(float(timers[name]()))
    return samples


def paired_quantiles(f: Callable[..., float], *series: list) -> dict:
    """{'p20','p50','p80'} of f applied round by round to equally long series of `interleaved_samples` (e.g. the
    ratio of two implementations' times taken in the same round): a drift between rounds cancels in each pair."""
    lengths = {len(s) for s in series}
    if len(lengths) != 1 or not lengths.pop():
        raise ValueError("paired_quantiles needs equally long, non-empty series; got lengths "
                         f"{[len(s) for s in series]}")
    return quantiles([f(*xs) for xs in zip(*series)])


def pick_profile(profiles: dict, profile: str):
    """(the profile's settings, device) for a benchmark; the gpu profile refuses to run without CUDA so CPU
    timings are never recorded as GPU numbers."""
    import torch

    from glm5lab.errors import Glm5labError

    if profile not in profiles:
        raise Glm5labError(f"unknown benchmark profile {profile!r}; expected one of {sorted(profiles)}")
    cuda = torch.cuda.is_available()
    if profile == "gpu" and not cuda:
        raise Glm5labError("the gpu benchmark profile needs a CUDA device; use profile 'cpu'")
    if not cuda:
        from glm5lab.env import interpreter_mode

        if not interpreter_mode():   # Triton picks interpreter or compiler as it loads: too late to set it here
            raise Glm5labError("without a GPU the Triton kernels run in Triton's interpreter: start Python with "
                               "TRITON_INTERPRET=1 (glm5lab bench --suite cpu and notebooks run set it)")
    return profiles[profile], ("cuda" if cuda else "cpu")


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s); the memory ceiling that
    roofline fractions are taken against, measured in the same run. None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), warmup_ms=50, rep_ms=200)
    return 2 * src.numel() / (t["p50"] * 1e-6) / 1e9
