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


def test_first_implementation_of_a_shape_is_timed_twice_on_a_gpu_and_the_first_timing_discarded():
    """The position effect (NOTES.md v8, v9): on a GPU the first implementation of a shape gets a discarded timing
    first; every implementation is recorded exactly once, in the order given; without a GPU nothing extra runs."""
    impls = [("glm5lab", "bf16"), ("glm5lab-triton", "bf16"), ("flashmla", "bf16")]
    order = kernel_bench.timing_order(impls, cuda=True)
    assert order[0] == (False, impls[0]) and [i for rec, i in order if rec] == impls
    assert kernel_bench.timing_order(impls, cuda=False) == [(True, i) for i in impls]
    assert kernel_bench.timing_order([], cuda=True) == []
