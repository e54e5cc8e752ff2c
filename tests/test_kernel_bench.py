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


def _drifting_clock():
    """Timers of identical 'kernels' on a clock that slows by 1% a call: what one-after-another timing meets when
    the GPU heats or the first implementation of a shape comes out slow."""
    calls = []

    def timer(name):
        def one():
            calls.append(name)
            return 100.0 * (1 + 0.01 * len(calls))
        return one
    return timer, calls


def test_interleaved_rounds_give_identical_kernels_equal_times_under_a_drift():
    """timing.interleaved_rounds (the benchmark's --interleave): every round calls each timer once, the order
    rotated a place a round; under a drifting clock two identical kernels get medians within the drift of one
    round, where timing one after another puts the whole drift between them."""
    from glm5lab.bench.timing import interleaved_rounds

    timer, calls = _drifting_clock()
    seq = {n: [timer(n)() for _ in range(15)] for n in ("a", "b", "c")}     # one after another
    seq_gap = sorted(seq["c"])[7] - sorted(seq["a"])[7]
    timer, calls = _drifting_clock()
    res = interleaved_rounds({n: timer(n) for n in ("a", "b", "c")}, rounds=15)
    gap = max(r["p50"] for r in res.values()) - min(r["p50"] for r in res.values())
    assert seq_gap > 25 and gap <= 3                          # 30 us one after another, <= 3 us interleaved
    assert all(r["p20"] <= r["p50"] <= r["p80"] for r in res.values())
    assert len(calls) == 45 and all(calls.count(n) == 15 for n in "abc")
    firsts = {calls[3 * r] for r in range(15)}                 # each implementation opens some round
    assert firsts == {"a", "b", "c"}


def test_interleave_is_a_gpu_option_that_a_cpu_run_leaves_out(tmp_path):
    """--interleave times CUDA graphs: on the CPU profile the run writes no interleaved rows, and a negative
    number of rounds is refused by the command line."""
    import pytest

    csv = tmp_path / "bench.csv"
    kernel_bench.run(csv, "cpu", heads=(8,), tokens=(1,), verbose=False, interleave=5, skip=("torch-gather",))
    assert "time_graph_interleaved" not in set(pd.read_csv(csv).metric)
    with pytest.raises(SystemExit):
        kernel_bench.main(["--out", str(tmp_path / "x.csv"), "--interleave", "-1"])
