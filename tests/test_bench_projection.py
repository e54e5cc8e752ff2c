"""The 8x RTX PRO 6000 projection: assumptions sourced, missing inputs named (never invented), measured
efficiencies used when present, capacity respected, projected values labeled."""
import pandas as pd
import pytest

from glm5lab.bench import plots, projection


def _measured(eff_att=0.5, eff_idx=0.4, eff_w=0.7, topk_us=None) -> pd.DataFrame:
    """Rows shaped like the full suite's (kernel_bench, indexer_bench, gemm_streaming) on a GPU."""
    rows = []
    for T in (1, 8, 32, 128, 512):
        rows.append(dict(suite="sparse_mla_kernel", implementation="glm5lab", layout="fp8_ds_mla", dtype="bf16",
                         shape=f"H8_T{T}_K2048", metric="roofline_fraction", value=eff_att))
    for B in (1, 32, 128, 256):
        for L in (4096, 16384, 65536):
            rows.append(dict(suite="dsa_indexer", implementation="glm5lab-triton", layout="paged64", dtype="fp8",
                             shape=f"B{B}_L{L}_H32_D128_K2048", metric="fraction_of_copy_ceiling", value=eff_idx))
            for method, us in (topk_us or {"hist": 30.0, "split": 130.0}).items():
                rows.append(dict(suite="dsa_indexer", implementation=f"glm5lab-triton-{method}", layout="paged64",
                                 dtype="fp8", shape=f"B{B}_L{L}_H32_D128_K2048", metric="topk_time", value=us))
    for B in (1, 8, 32, 64, 128, 256):
        rows.append(dict(suite="gemm_streaming", implementation="torch-bf16-gemm", layout="-", dtype="bf16",
                         shape=f"B{B}_N24576_K6144", metric="fraction_of_copy", value=eff_w))
    df = pd.DataFrame(rows)
    df["gpu"], df["triton_interpret"] = "NVIDIA H200", False
    return df


@pytest.fixture(scope="module")
def projections():
    kw = dict(qtypes=("Q4_K", "Q8_0"), batches=(1, 32, 256), contexts=(4096, 65536))
    return (projection.project(measurements=pd.DataFrame(), **kw),
            projection.project(measurements=_measured(), **kw))


def test_assumptions_have_sources_and_kinds():
    a = projection.assumptions()
    assert set(a.kind) <= {"published", "derived", "assumption", "measured"}
    assert (a.source.str.len() > 10).all()
    assert {"published", "assumption", "measured"} <= set(a.kind)


def test_without_measurements_only_the_upper_bound_is_computed(projections):
    empty, _ = projections
    proj = empty[empty.kind == "projection"]
    assert proj.missing_inputs.str.contains("no GPU-measured rows").all()
    assert "tokens_per_s" not in proj or proj.tokens_per_s.isna().all()
    ub = empty[empty.kind != "projection"]
    assert (ub[ub.fits].tokens_per_s > 0).all()


def test_measured_efficiencies_slow_the_projection_below_the_bound(projections):
    empty, meas = projections
    p = meas[(meas.kind == "projection") & meas.fits].set_index(["qtype", "batch", "context"])
    ub = meas[(meas.kind != "projection") & meas.fits].set_index(["qtype", "batch", "context"])
    assert not p.empty
    assert (p.tokens_per_s < ub.loc[p.index].tokens_per_s).all()
    assert (p.eff_attention == 0.5).all() and (p.eff_indexer == 0.4).all() and (p.eff_weights == 0.7).all()
    # weight streaming at 0.7 of the bandwidth takes 1/0.7 of the bound's time
    ratio = p.weights_ms / ub.loc[p.index].weights_ms
    assert ratio.sub(1 / 0.7).abs().max() < 1e-9


def test_capacity_and_batch_behaviour(projections):
    _, meas = projections
    ub = meas[meas.kind != "projection"]
    # Q8_0 GLM-5 (~800 GB) cannot fit in 8 x 96 GB; Q4_K (~420 GB) does at short context
    assert not ub[ub.qtype == "Q8_0"].fits.any()
    q4 = ub[(ub.qtype == "Q4_K") & (ub.context == 4096)].set_index("batch")
    assert q4.loc[1].fits and q4.loc[1].resident_gb < 96
    # the latent KV cache is replicated across TP ranks: long context x large batch cannot fit
    assert not ub[(ub.qtype == "Q4_K") & (ub.batch == 256) & (ub.context == 65536)].fits.any()
    # more concurrent streams share the weight reads: throughput grows with batch where it fits
    assert q4.loc[32].tokens_per_s > q4.loc[1].tokens_per_s


def test_efficiency_lookup_names_each_missing_input():
    eff, missing = projection.efficiencies(_measured().query("suite != 'gemm_streaming'"), 32, 16384)
    assert set(eff) == {"attention", "indexer", "topk_us"}
    assert len(missing) == 1 and "gemm" in missing[0].lower()


def test_attention_efficiency_is_the_portable_kernels_when_the_run_has_both():
    """On an H200 "glm5lab" fp8 rows are the Hopper-only Gluon kernel; a Blackwell projection must read the Triton
    kernel's rows ("glm5lab-triton") of the same run when they exist, and "glm5lab" otherwise."""
    df = _measured(eff_att=0.42)
    eff, _ = projection.efficiencies(df, 32, 16384)
    assert eff["attention"] == pytest.approx(0.42)
    triton = df[df.implementation == "glm5lab"].assign(implementation="glm5lab-triton", value=0.34)
    eff, _ = projection.efficiencies(pd.concat([df, triton]), 32, 16384)
    assert eff["attention"] == pytest.approx(0.34)


def test_efficiencies_come_from_cuda_graph_time_where_the_run_has_it():
    """vLLM runs a decode step in a CUDA graph: at a batch of one, do_bench's time is mostly launch overhead (the
    H200's Triton kernel: 72 us against 8.7 us in a graph). Where the suite has graph-timed fractions the projection
    takes them, per quantity, and do_bench's otherwise."""
    slow = _measured(eff_att=0.05, eff_idx=0.01)
    graph = slow[slow.metric.isin(["roofline_fraction", "fraction_of_copy_ceiling"])]
    graph = graph.assign(metric=graph.metric + "_graph", value=graph.metric.map({"roofline_fraction": 0.4,
                                                                                "fraction_of_copy_ceiling": 0.3}))
    fractions = ("attention", "indexer", "weights")
    assert {k: projection.efficiencies(slow, 1, 4096)[0][k] for k in fractions} == \
        {"attention": 0.05, "indexer": 0.01, "weights": 0.7}
    assert {k: projection.efficiencies(pd.concat([slow, graph]), 1, 4096)[0][k] for k in fractions} == \
        {"attention": 0.4, "indexer": 0.3, "weights": 0.7}
    only_attention = pd.concat([slow, graph[graph.suite == "sparse_mla_kernel"]])
    assert projection.efficiencies(only_attention, 1, 4096)[0]["indexer"] == 0.01
    kw = dict(qtypes=("Q4_K",), batches=(1,), contexts=(4096,))
    before, after = (projection.project(measurements=m, **kw).query("kind == 'projection'").iloc[0]
                     for m in (slow, pd.concat([slow, graph])))
    assert after.kv_ms == pytest.approx(before.kv_ms * 0.05 / 0.4) and after.step_ms < before.step_ms


def test_the_indexer_top_k_time_is_the_measured_kernel_s_that_the_indexer_op_runs_at_that_context():
    """The top-k is bound by latency, not by memory: the projection adds, per layer, the time measured for the kernel
    glm5lab's indexer op picks (`fastest_topk_method`: hist at 4k x 32 rows, split at 4k x 1 and 64k x 32); its
    upper bound reads the logits once."""
    from glm5lab.bench.projection import model_bytes

    df = _measured(topk_us={"hist": 30.0, "split": 130.0, "radix16": 700.0})
    assert projection.topk_time_us(df, 32, 4096) == 30.0 and projection.topk_time_us(df, 32, 65536) == 130.0
    assert projection.topk_time_us(df, 1, 4096) == 130.0
    layers = model_bytes("Q4_K")["layers"]
    p = projection.project(measurements=df, qtypes=("Q4_K",), batches=(32,), contexts=(4096, 65536))
    proj = p[p.kind == "projection"].set_index("context")
    assert proj.topk_ms.tolist() == pytest.approx([layers * 30e-3, layers * 130e-3])
    parts = proj.weights_ms + proj.kv_ms + proj.indexer_ms + proj.topk_ms
    assert (proj.step_ms - proj.allreduce_ms).tolist() == pytest.approx(parts.tolist())
    bound = p[p.kind != "projection"].set_index("context")
    assert bound.topk_ms.tolist() == pytest.approx([32 * layers * L * 4 / 1792e9 * 1e3 for L in (4096, 65536)])
    # graph-timed rows of the kernel, where the run has them (the multi-launch split loses most of its do_bench time)
    graph = df[(df.metric == "topk_time") & (df.implementation == "glm5lab-triton-split")]
    graph = graph.assign(metric="topk_time_graph", value=40.0)
    assert projection.topk_time_us(pd.concat([df, graph]), 32, 65536) == 40.0
    assert projection.topk_time_us(pd.concat([df, graph]), 32, 4096) == 30.0      # (no graph rows of hist)
    no_topk = df[df.metric != "topk_time"]
    assert "top-k" in projection.efficiencies(no_topk, 1, 4096)[1][0]
    assert projection.project(measurements=no_topk, qtypes=("Q4_K",), batches=(1,), contexts=(4096,)).query(
        "kind == 'projection'").missing_inputs.str.contains("top-k").all()


def test_projection_plot_marks_projected_values(projections, tmp_path):
    _, meas = projections
    rows = pd.DataFrame(projection.projection_rows(meas))
    fig = plots.plot_projection(rows, "gpu")
    texts = [t.get_text() for t in fig.axes[0].texts] + [fig.axes[0].get_ylabel()]
    labels = [h.get_label() for h in fig.axes[0].get_lines()]
    assert any("PROJECTION" in t for t in texts)
    assert any(lab.startswith("PROJECTED") for lab in labels)
    assert any(lab.startswith("upper bound") for lab in labels)
    # the title names the GPU whose efficiencies fed it (it said "H200" whatever had measured them); rows of a
    # CSV from before a provenance column existed have no GPU (NaN), which must not break the name
    measured_on = meas["measured_on"].iloc[0]
    assert measured_on and f"fed by {measured_on} efficiencies" in fig.axes[0].get_title()
    rows = _measured()
    rows = pd.concat([rows, rows.iloc[:1].assign(gpu=float("nan"), metric="unrelated")], ignore_index=True)
    assert projection.project(measurements=rows, qtypes=("Q4_K",), batches=(1,), contexts=(4096,)).measured_on.iloc[
        0] == measured_on


def test_the_indexer_efficiency_is_the_e4m3_q_logits_where_the_run_has_them():
    """glm5lab's vLLM op hands the fp8 keys' logits vLLM's e4m3 q (v58): where the indexer bench timed that
    ("glm5lab-triton-q8"), the projection's indexer efficiency is its, and the widened q's otherwise."""
    df = _measured(eff_idx=0.8)
    assert projection.efficiencies(df, 32, 16384)[0]["indexer"] == pytest.approx(0.8)
    q8 = df[(df.implementation == "glm5lab-triton") & (df.metric == "fraction_of_copy_ceiling")]
    q8 = q8.assign(implementation="glm5lab-triton-q8", value=0.93)
    assert projection.efficiencies(pd.concat([df, q8]), 32, 16384)[0]["indexer"] == pytest.approx(0.93)


def test_assumptions_name_the_gpu_that_measured_the_inputs():
    a = projection.assumptions(measured_on="NVIDIA H100 80GB HBM3").set_index("quantity")
    for q in ("indexer top-k time", "efficiencies"):
        assert a.loc[q, "value"] == "NVIDIA H100 80GB HBM3 full suite"
        assert "H200" not in a.loc[q, "value"] + a.loc[q, "source"]
    unnamed = projection.assumptions().set_index("quantity")
    assert "H200" not in unnamed.loc["efficiencies", "value"]


def test_the_csv_rows_say_what_they_project_for(projections):
    """The rows' gpu column names the machine that computed them: the CSV itself must say the figures are a
    PROJECTION for 8x RTX PRO 6000 Blackwell, or a reader of the file alone takes them for that GPU's measurements."""
    _, measured = projections
    rows = pd.DataFrame(projection.projection_rows(measured))
    target = rows[rows.metric == "projected_for"]
    assert len(target) == 1
    assert all(w in target.unit.iloc[0] for w in ("PROJECTION", "RTX PRO 6000 Blackwell", "SM120", "not measured"))
