"""The kernel benchmark's CPU profile: the code path the H200 run takes, on tiny shapes, writing
long-format rows with provenance (timings under the interpreter are not performance)."""
import pandas as pd

from glm5lab.bench import kernel_bench
from glm5lab.bench.kernel_plots import roofline_figure, summary


def test_cpu_profile_writes_rows_and_checks_accuracy(tmp_path):
    csv = tmp_path / "bench.csv"
    df = kernel_bench.run(csv, "cpu", heads=(8,), tokens=(1,), verbose=False)
    assert {("glm5lab", "bf16"), ("glm5lab", "fp8_ds_mla"), ("torch-gather", "bf16")} <= set(zip(df.impl, df.layout))
    assert (df[df.impl == "glm5lab"].rel_err < 1.6e-2).all()        # bf16 bound, see test_sparse_mla_kernel
    rows = pd.read_csv(csv)
    assert {"time", "rel_err_out", "min_bytes", "flops"} <= set(rows.metric)
    assert rows.triton_interpret.astype(str).str.lower().eq("true").all()
    w = summary(csv)
    assert set(w.H) == {8} and set(w.tokens) == {1}
    fig, _ = roofline_figure(csv, tmp_path / "roofline.png")
    assert (tmp_path / "roofline.png").stat().st_size > 0


def test_settle_runs_the_call_for_at_least_the_time_asked():
    """The benchmark's settle (NOTES.md v8): at least one call, and calls until the time has passed."""
    import time

    from glm5lab.bench.timing import settle

    stamps = []
    t0 = time.perf_counter()
    calls = settle(lambda: stamps.append(time.perf_counter()), seconds=0.05)
    assert calls == len(stamps) >= 1
    assert time.perf_counter() - t0 >= 0.05 and stamps[-1] - t0 >= 0.04
    assert settle(lambda: None, seconds=0.0) == 1
