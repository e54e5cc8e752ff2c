"""The kernel benchmark's CPU profile: the code path the H200 run takes, on tiny shapes, writing
long-format rows with provenance (timings under the interpreter are not performance)."""
import pandas as pd
import pytest

from glm5lab.bench import kernel_bench
from glm5lab.bench.kernel_plots import roofline_figure, summary


def test_cpu_profile_writes_rows_and_checks_accuracy(tmp_path):
    """The command line's run, with its per-shape summary table: the summary carries the provenance of the rows it
    summarizes (it is read alone, as results/kernels/summary_v*.csv are)."""
    csv, table = tmp_path / "bench.csv", tmp_path / "summary.csv"
    assert kernel_bench.main(["--out", str(csv), "--profile", "cpu", "--heads", "8", "--tokens", "1",
                              "--summary", str(table)]) == 0
    df = pd.read_csv(table)
    assert {("glm5lab", "bf16"), ("glm5lab", "fp8_ds_mla"), ("torch-gather", "bf16")} <= set(zip(df.impl, df.layout))
    assert (df[df.impl == "glm5lab"].rel_err < 1.6e-2).all()        # bf16 bound, see test_sparse_mla_kernel
    rows = pd.read_csv(csv)
    for col in ("gpu", "torch", "triton", "git_sha", "timestamp", "command"):
        assert df[col].nunique() == 1 and df[col].iloc[0] == rows[col].iloc[-1], col
    assert set(df.summarizes) == {"bench.csv"} and "--summary" in df.command.iloc[0]
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
    """timing.interleaved_samples (the benchmark's --interleave): every round calls each timer once, the order
    rotated a place a round; under a drifting clock two identical kernels get medians within the drift of one
    round, where timing one after another puts the whole drift between them."""
    from glm5lab.bench.timing import interleaved_samples, quantiles

    timer, calls = _drifting_clock()
    seq = {n: [timer(n)() for _ in range(15)] for n in ("a", "b", "c")}     # one after another
    seq_gap = sorted(seq["c"])[7] - sorted(seq["a"])[7]
    timer, calls = _drifting_clock()
    samples = interleaved_samples({n: timer(n) for n in ("a", "b", "c")}, rounds=15)
    assert all(len(xs) == 15 for xs in samples.values())
    res = {n: quantiles(xs) for n, xs in samples.items()}
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


def test_layouts_limits_the_run_to_the_named_cache_layouts(tmp_path):
    """--layouts fp8_ds_mla (an A/B of fp8 kernels): only that layout's rows, every implementation of it; a layout
    the benchmark does not know is refused by name."""
    import pytest

    from glm5lab.errors import Glm5labError

    csv = tmp_path / "bench.csv"
    df = kernel_bench.run(csv, "cpu", heads=(8,), tokens=(1,), verbose=False, layouts="fp8_ds_mla")
    assert set(df.layout) == {"fp8_ds_mla"} and "glm5lab" in set(df.impl)
    assert set(pd.read_csv(csv).query("layout != '-'").layout) == {"fp8_ds_mla"}
    with pytest.raises(Glm5labError, match="layouts \\['fp16'\\]"):
        kernel_bench.run(csv, "cpu", heads=(8,), tokens=(1,), verbose=False, layouts=("fp16",))


def test_interleaved_rows_take_the_ratio_to_flashmla_round_by_round_so_a_drift_cancels():
    """kernel_bench.interleaved_rows: the machine slows 3% a round (clock, heat) and ours is 2.25x faster than
    FlashMLA in every round. The round-by-round ratio gives exactly that at p20, p50 and p80, while the p50 times
    show the drift's middle; the roofline fraction is the time's against the run's copy bandwidth; FlashMLA gets
    no ratio to itself, and without a copy bandwidth no roofline row is written."""
    from glm5lab.bench.kernel_bench import interleaved_rows

    ours = [200.0 * 1.03 ** r for r in range(9)]
    fm = [2.25 * t for t in ours]
    min_bytes, bw = {"fp8_ds_mla": 688_000_000, "bf16": 1_200_000_000}, 4200.0
    samples = {("glm5lab", "fp8_ds_mla"): ours, ("flashmla", "fp8_ds_mla"): fm}
    rows, head = interleaved_rows("H8_T512_K2048", samples, min_bytes, bw)
    got = {(r["implementation"], r["metric"]): r for r in rows}
    r = got[("glm5lab", "speedup_vs_flashmla_interleaved")]
    assert abs(r["p20"] - 2.25) < 1e-9 and abs(r["p50"] - 2.25) < 1e-9 and abs(r["p80"] - 2.25) < 1e-9
    assert ("flashmla", "speedup_vs_flashmla_interleaved") not in got
    t = got[("glm5lab", "time_graph_interleaved")]
    assert t["value"] == sorted(ours)[4] and t["p80"] > t["p20"]
    roof = got[("glm5lab", "roofline_fraction_interleaved")]
    assert abs(roof["value"] - 688e6 / (sorted(ours)[4] * 1e-6) / 1e9 / bw) < 1e-12 and roof["p20"] < roof["p80"]
    assert abs(got[("flashmla", "roofline_fraction_interleaved")]["value"] - roof["value"] / 2.25) < 1e-12
    assert head[("glm5lab", "fp8_ds_mla")] == {"us": t["value"], "roofline": roof["value"], "x_fm": r["value"]}
    # rounds that disagree: the ratio is the median of the rounds' ratios (2.2), not the ratio of medians (2.18)
    rows, head = interleaved_rows("s", {("glm5lab", "bf16"): [100.0, 110.0, 120.0],
                                        ("flashmla", "bf16"): [240.0, 231.0, 264.0]}, min_bytes)
    assert abs(head[("glm5lab", "bf16")]["x_fm"] - 2.2) < 1e-12
    assert "roofline_fraction_interleaved" not in {r["metric"] for r in rows}
    assert head[("glm5lab", "bf16")]["roofline"] != head[("glm5lab", "bf16")]["roofline"]    # NaN: no bandwidth


def test_paired_quantiles_refuse_series_of_different_rounds():
    import pytest

    from glm5lab.bench.timing import paired_quantiles

    assert paired_quantiles(lambda a, b: a / b, [2.0, 4.0, 6.0], [1.0, 2.0, 3.0])["p50"] == 2.0
    with pytest.raises(ValueError, match="equally long"):
        paired_quantiles(lambda a, b: a / b, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        paired_quantiles(lambda a: a, [])


def _bench_rows(run: str, values: dict) -> list:
    """kernel_bench-shaped rows {(implementation, layout, shape, metric): value} of one suite run."""
    return [{"suite": "sparse_mla_kernel", "implementation": i, "shape": s, "dtype": "bf16", "layout": lay,
             "metric": m, "value": v, "unit": "-"} for (i, lay, s, m), v in values.items()]


def test_headline_table_reads_the_last_run_cell_by_cell(tmp_path):
    """kernel_plots.headline_table (the README's kernel table): the LAST run only; each cell's time, x FlashMLA and
    (from 128 tokens) roofline read as targets_table reads them -- interleaved rounds first, else the CUDA-graph
    pass with x = FlashMLA's time / ours, else do_bench; no x without FlashMLA; "n/a" for a shape the run lacks."""
    from glm5lab.bench.kernel_plots import HEADLINE_HEADS, HEADLINE_TOKENS, headline_table
    from glm5lab.bench.records import append_rows

    fp8, k = "fp8_ds_mla", "_K2048"
    csv = tmp_path / "kernels.csv"
    append_rows(csv, _bench_rows("a", {("glm5lab", fp8, "H16_T1" + k, "time_graph"): 9.0}),
                command="glm5lab bench --suite full part=kernels run=20260101T000000Z")
    new = {("glm5lab", fp8, "H8_T1" + k, "time_graph_interleaved"): 7.14,
           ("glm5lab", fp8, "H8_T1" + k, "speedup_vs_flashmla_interleaved"): 2.79,
           ("glm5lab", fp8, "H8_T1" + k, "time_graph"): 7.5,                         # not read: interleaved first
           ("glm5lab", fp8, "H8_T128" + k, "time_graph"): 55.0,
           ("flashmla", fp8, "H8_T128" + k, "time_graph"): 110.0,
           ("glm5lab", fp8, "H8_T128" + k, "roofline_fraction_graph"): 0.761,
           ("glm5lab", "bf16", "H8_T512" + k, "time"): 304.4,
           ("glm5lab", "bf16", "H8_T512" + k, "roofline_fraction"): 0.953,
           ("glm5lab", "bf16", "H8_T8" + k, "time_graph"): 12.14,
           ("glm5lab", "bf16", "H8_T8" + k, "roofline_fraction_graph"): 0.37}   # not shown below 128 tokens
    append_rows(csv, _bench_rows("b", new), command="glm5lab bench --suite full part=kernels run=20260102T000000Z")
    lines = headline_table(csv).splitlines()
    assert len(lines) == 2 + 2 * len(HEADLINE_HEADS)
    cells = {}
    for line in lines[2:]:
        name, *row = [c.strip() for c in line.strip("|").split("|")]
        cells.update({(name, T): c for T, c in zip(HEADLINE_TOKENS, row)})
    assert cells[("fp8_ds_mla, 8", 1)] == "7.1 µs, 2.79×"
    assert cells[("fp8_ds_mla, 8", 128)] == "55.0 µs, 2.00×, 0.76"
    assert cells[("bf16, 8", 512)] == "304 µs, 0.95"
    assert cells[("bf16, 8", 8)] == "12.1 µs"
    assert cells[("fp8_ds_mla, 16", 1)] == "n/a"                       # only the earlier run measured it
    assert sum(c == "n/a" for c in cells.values()) == len(cells) - 4


@pytest.mark.measured
def test_readme_kernel_table_is_the_committed_suite_run():
    """The README's kernel table is headline_table of the committed GPU suite run, not numbers typed by hand: a
    new suite run must come with the regenerated table (`glm5lab bench --suite full --headline`)."""
    from pathlib import Path

    from glm5lab.bench.kernel_plots import headline_table

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().splitlines()
    start = next(i for i, x in enumerate(readme) if x.strip().startswith("| cache, heads |"))
    end = next(i for i in range(start, len(readme)) if not readme[i].strip().startswith("|"))
    table = "\n".join(x.strip() for x in readme[start:end])
    assert table == headline_table(root / "results" / "bench" / "gpu" / "kernels.csv"), (
        "README.md's kernel table is not the committed suite run's: paste `glm5lab bench --suite full --headline`")


def test_targets_table_reads_the_last_run_and_prefers_the_interleaved_rounds(tmp_path):
    """kernel_plots.targets_table: issue 7's targets against the LAST run of the CSV; a quantity comes from the
    interleaved rounds where the run has them, else from the CUDA-graph pass (x FlashMLA = FlashMLA's graph time /
    ours); "at most" and "at least" goals both judged; a target whose shape the run lacks is unmeasured, not failed."""
    from glm5lab.bench.kernel_plots import ISSUE_TARGETS, targets_table
    from glm5lab.bench.records import append_rows

    fp8, k = "fp8_ds_mla", "_K2048"
    csv = tmp_path / "kernels.csv"
    old = {("glm5lab", fp8, "H8_T1" + k, "time_graph"): 5.0,                 # an earlier run that met it ...
           ("glm5lab", "bf16", "H16_T128" + k, "roofline_fraction_graph"): 0.9}   # ... and measured a shape
    append_rows(csv, _bench_rows("a", old), command="glm5lab bench --suite full part=kernels run=20260101T000000Z")
    new = {("glm5lab", fp8, "H8_T1" + k, "time_graph"): 9.0,
           ("glm5lab", fp8, "H8_T8" + k, "time_graph"): 7.5,
           ("glm5lab", fp8, "H8_T512" + k, "roofline_fraction_graph"): 0.80,
           ("glm5lab", fp8, "H8_T512" + k, "roofline_fraction_interleaved"): 0.86,
           ("glm5lab", fp8, "H8_T512" + k, "time_graph"): 200.0,
           ("flashmla", fp8, "H8_T512" + k, "time_graph"): 430.0,                # 2.15x sequentially ...
           ("glm5lab", fp8, "H8_T512" + k, "speedup_vs_flashmla_interleaved"): 2.3,   # ... 2.3x round by round
           ("glm5lab", fp8, "H16_T512" + k, "time_graph"): 250.0,
           ("flashmla", fp8, "H16_T512" + k, "time_graph"): 450.0}
    append_rows(csv, _bench_rows("b", new), command="glm5lab bench --suite full part=kernels run=20260102T000000Z")
    t = targets_table(csv)
    assert len(t) == len(ISSUE_TARGETS)
    row = {(r.quantity, r.heads, r.tokens, r.layout): r for r in t.itertuples()}
    assert (row[("us", 8, 1, fp8)].measured, row[("us", 8, 1, fp8)].met) == (9.0, False)     # the last run's value
    assert (row[("us", 8, 8, fp8)].met, row[("us", 8, 8, fp8)].source) == (True, "graph")
    r = row[("roofline", 8, 512, fp8)]
    assert (r.measured, r.met, r.source) == (0.86, True, "interleaved")
    r = row[("x_fm", 8, 512, fp8)]
    assert (r.measured, r.met, r.source) == (2.3, True, "interleaved")
    r = row[("x_fm", 16, 512, fp8)]
    assert abs(r.measured - 1.8) < 1e-12 and r.met is False and r.source == "graph"
    r = row[("roofline", 16, 128, "bf16")]
    assert r.measured != r.measured and r.met is None and r.source == ""


def test_captured_graph_and_its_timer_keep_the_calls_alive(monkeypatch):
    """A CUDA graph replays its calls' kernels on whatever those calls held outside the graph's memory pool (FlashMLA's
    scheduler metadata): `capture_graph`'s graph holds the calls and `graph_timer`'s timer the graph, or a replay reads
    freed memory (v41 call 6: "operation not supported on global/shared address space" in the suite's rounds). The
    CUDA calls are stand-ins here; the capture is kernel_bench's own."""
    import contextlib
    import gc
    import weakref

    import torch

    from glm5lab.bench import kernel_bench

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())

    class Call:
        runs = 0

        def __call__(self):
            Call.runs += 1

    call = Call()
    held = weakref.ref(call)
    timer = kernel_bench.graph_timer([call])
    del call
    gc.collect()
    assert Call.runs == 2                                  # run once beside the graph, once captured
    assert held() is not None and timer.graph.calls == [held()]


def test_other_gpu_tiles_and_named_tiles_are_timed_beside_the_default(tmp_path):
    """other_gpu_tiles: a row for each other GPU's bf16 tile where it differs from this device's (40 heads: SM120's 64 x
    16, SM100's 32-head tile; 8 heads: the same tile everywhere, so no row); a tile or a _config asked for by name: a
    row at every head count. Each is checked against the reference."""
    csv = tmp_path / "bench.csv"
    df = kernel_bench.run(csv, "cpu", heads=(8, 40), tokens=(2,), verbose=False, layouts="bf16", other_gpu_tiles=True,
                          variants=False, skip=("torch-gather", "virtual-block-table"), tiles=("16x32w4",),
                          configs={"n16": {"impl": "triton", "block_n": 16}})
    other = df[df.impl.str.endswith("-tile")]
    assert set(zip(other.impl, other.H)) == {(f"glm5lab-triton-{gpu}-tile", 40) for gpu in kernel_bench.OTHER_GPU_TILES}
    assert set(df[df.impl == "glm5lab-triton-16x32w4"].H) == set(df[df.impl == "glm5lab-n16"].H) == {8, 40}
    assert (df[df.impl.str.startswith("glm5lab-")].rel_err < 1.6e-2).all()


def test_a_tile_is_named_heads_x_rows_w_warps():
    import pytest

    from glm5lab.errors import Glm5labError

    assert kernel_bench.parse_tile("64x16w8") == {"impl": "triton", "block_h": 64, "block_n": 16, "num_warps": 8,
                                                  "num_stages": 2}
    with pytest.raises(Glm5labError, match="'64x16': expected <block_h>x<block_n>w<warps>"):
        kernel_bench.parse_tile("64x16")


def test_a_named_config_is_a_name_and_a_json_object():
    import pytest

    from glm5lab.errors import Glm5labError

    assert kernel_bench.parse_named_config('n16={"impl": "triton", "block_n": 16}') == (
        "n16", {"impl": "triton", "block_n": 16})
    for bad in ("n16", '={"a": 1}', "n16=[16]", "n16={block_n: 16}"):
        with pytest.raises(Glm5labError, match="config 'n16|config '="):
            kernel_bench.parse_named_config(bad)


def test_summary_reads_the_last_run_only(tmp_path):
    """Notebook 05 draws the CSV before the run's archiving: an implementation that failed in the last run used to
    show the earlier run's time under the last run's provenance."""
    from glm5lab.bench.records import append_rows

    csv = tmp_path / "kernels.csv"

    def rows(impls, value):
        return [{"suite": "sparse_mla_kernel", "implementation": impl, "shape": "H8_T1_K64", "dtype": "bfloat16",
                 "layout": "bf16", "metric": "time", "value": value, "unit": "us"} for impl in impls]

    append_rows(csv, rows(["glm5lab", "torch-gather"], 111.0), command="bench run=A")
    append_rows(csv, rows(["torch-gather"], 222.0), command="bench run=B")      # glm5lab failed in run B
    w = summary(csv)
    assert w.implementation.tolist() == ["torch-gather"] and w.time.tolist() == [222.0]
