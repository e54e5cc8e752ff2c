"""Tensor-parallel attention stack (issue 11) on CPU: gloo, tiny widths, a couple of steps.

What must hold on any machine: the head-sliced layer summed over slices (through a real all-reduce)
equals the unsharded layer; the all-reduce share is measured inside the step and lies in (0, 1); the
rows land in the CSV with the machine kind / world size in `layout`. And the paper model of the
all-reduce cost follows its formula and says it is a model.
"""
import csv
import math

import pandas as pd
import pytest
import torch

from glm5lab.bench import allreduce_model as arm
from glm5lab.bench import tensor_parallel as tp
from glm5lab.bench.attention_stack import AttentionLayer, StackShape
from glm5lab.errors import Glm5labError

CPU_SHAPE = StackShape(**tp.PROFILES["cpu"].shape_kw)
BF16_REL_TOL = 2e-2   # bf16 weights/activations; partial o_proj sums in float vs one bf16 GEMM (~3e-3 seen)


def _by_metric(rows, layout):
    return {r["metric"]: r for r in rows if r["layout"] == layout}


def test_head_slices_sum_to_the_unsharded_layer_and_a_wrong_split_does_not():
    torch.manual_seed(0)
    full = AttentionLayer(CPU_SHAPE, 4, 3, 40, "cpu", seed=7)
    with torch.no_grad():
        ref = tp.partial_output(full, "torch").float()
        parts = [tp.partial_output(tp.shard_heads(full, i, 2), "torch").float() for i in range(2)]
        assert parts[0].shape == ref.shape and parts[0].abs().max() > 0
        err = (parts[0] + parts[1] - ref).abs().max() / ref.abs().max()
        assert err < BF16_REL_TOL
        # teeth: o_proj columns of the other slice's heads must give a different answer
        wrong = tp.shard_heads(full, 0, 2)
        wrong.w_o = tp.shard_heads(full, 1, 2).w_o
        bad = tp.partial_output(wrong, "torch").float() + parts[1]
        assert (bad - ref).abs().max() / ref.abs().max() > 10 * BF16_REL_TOL
    with pytest.raises(Glm5labError, match="cannot take slice 0 of 3 from 4 heads"):
        tp.shard_heads(full, 0, 3)


def test_gloo_world_2_glm5lab_kernel_matches_unsharded_and_measures_the_allreduce(tmp_path):
    out = tmp_path / "tp" / "tp_attention_stack.csv"
    rows = tp.run(tp.RunConfig(world_size=2, backend="gloo", profile="cpu", impl="glm5lab", warmup=0, reps=2,
                               out=str(out), command="pytest"))
    tp_rows, one_rows = _by_metric(rows, "cpu-gloo:tp2:world2"), _by_metric(rows, "cpu-gloo:tp1:world1")
    assert tp_rows["max_rel_err_vs_unsharded"]["value"] < BF16_REL_TOL
    share = tp_rows["allreduce_share"]["value"]
    assert 0.0 < share < 1.0
    assert 0 < tp_rows["allreduce_time"]["value"] < tp_rows["step_time"]["value"]
    assert tp_rows["allreduce_isolated_time"]["value"] > 0
    assert tp_rows["allreduce_bytes"]["value"] == 2 * CPU_SHAPE.hidden * 2      # batch 2 x hidden x bf16
    assert tp_rows["step_time"]["shape"] == "H2_B2_L48" and one_rows["step_time"]["shape"] == "H4_B2_L48"
    ratio = one_rows["step_time"]["value"] / tp_rows["step_time"]["value"]
    assert math.isclose(tp_rows["speedup_vs_1gpu"]["value"], ratio, rel_tol=1e-9)
    with out.open() as fh:
        written = list(csv.DictReader(fh))
    assert len(written) == len(rows) and {w["suite"] for w in written} == {tp.SUITE}
    assert {w["layout"] for w in written} == {"cpu-gloo:tp2:world2", "cpu-gloo:tp1:world1"}
    assert all(w["command"] == "pytest" for w in written)


def test_world_1_runs_one_tp_slice_in_process_and_checks_all_slices(tmp_path):
    out = tmp_path / "rows.csv"
    rows = tp.run(tp.RunConfig(world_size=1, tp=4, backend="gloo", profile="cpu", impl="torch", warmup=0,
                               reps=2, batches=(1, 3), out=str(out)))
    for B in (1, 3):
        r = {x["metric"]: x for x in rows if x["shape"] == f"H1_B{B}_L48"}
        assert r["step_time"]["layout"] == "cpu-gloo:tp4:world1"
        assert r["max_rel_err_vs_unsharded"]["value"] < BF16_REL_TOL   # sum of all 4 slices == 4-head layer
        assert 0.0 <= r["allreduce_share"]["value"] <= 1.0
    assert len(pd.read_csv(out)) == len(rows)


def test_world_1_failure_or_spent_budget_becomes_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real = tp.time_tp_steps

    def flaky(layer, *a, **kw):
        if layer.B == 2:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(layer, *a, **kw)

    monkeypatch.setattr(tp, "time_tp_steps", flaky)
    rows = tp.run(tp.RunConfig(world_size=1, tp=2, backend="gloo", profile="cpu", impl="torch", warmup=0, reps=1,
                               batches=(2, 1), check=False, out=str(tmp_path / "a.csv")))
    failed = [r for r in rows if r["metric"] == "failed"]
    assert [r["shape"] for r in failed] == ["H2_B2_L48"] and "out of memory" in failed[0]["unit"]
    assert any(r["metric"] == "step_time" and r["shape"] == "H2_B1_L48" for r in rows)
    assert tp.main(["--world-size", "1", "--backend", "gloo", "--profile", "cpu", "--impl", "torch",
                    "--batches", "2", "--out", str(tmp_path / "b.csv")]) == 3           # a failed shape -> exit 3
    monkeypatch.setattr(tp, "time_tp_steps", real)
    rows = tp.run(tp.RunConfig(world_size=1, backend="gloo", profile="cpu", impl="torch", budget_s=-1.0,
                               batches=(1, 2), out=str(tmp_path / "c.csv")))
    assert [r["metric"] for r in rows] == ["skipped", "skipped"]


@pytest.mark.parametrize("kw, words", [
    (dict(world_size=2, tp=3), "tp=3"),
    (dict(world_size=2, tp=2, backend="nccl"), "needs CUDA"),
    (dict(world_size=1, impl="flash"), "implementation"),
    (dict(world_size=1, profile="huge"), "profile"),
])
def test_bad_configurations_are_one_line_errors(kw, words, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)     # the same verdicts on a GPU machine
    with pytest.raises(Glm5labError, match=words):
        tp.validate(tp.RunConfig(**{"backend": "gloo", "profile": "cpu", **kw}))


def test_cli_exit_code_for_a_bad_split(tmp_path, capsys):
    assert tp.main(["--world-size", "2", "--backend", "gloo", "--profile", "cpu", "--tp", "3",
                    "--out", str(tmp_path)]) == 1
    assert "error:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_gpu_world_1_one_tp8_slice_at_glm5_widths(tmp_path):
    """The single-GPU slice of the TP8 run through NCCL (world 1): the 8-head slices summed equal the
    64-head layer at real widths, and the rows carry the GPU."""
    rows = tp.run(tp.RunConfig(world_size=1, tp=8, backend="nccl", profile="gpu", batches=(1, 32),
                               reps=5, out=str(tmp_path / "tp.csv")))
    for B in (1, 32):
        r = {x["metric"]: x for x in rows if x["shape"] == f"H8_B{B}_L4096"}
        assert r["max_rel_err_vs_unsharded"]["value"] < BF16_REL_TOL
        assert 0.0 <= r["allreduce_share"]["value"] < 1.0 and r["step_time"]["value"] > 0
        assert r["step_time"]["layout"].endswith(":tp8:world1")
    assert (pd.read_csv(tmp_path / "tp.csv").gpu != "no GPU").all()


# ------------------------------------------------------------------------------ the paper model
def test_ring_allreduce_model_follows_its_formula_and_is_labeled(tmp_path):
    df = arm.decode_step_allreduce(batches=(1, 7, 256), gpus=(1, 2, 8))
    links = arm.links()
    for r in df.itertuples():
        link = links[r.link]
        nbytes = r.batch * 6144 * 2
        n = r.gpus
        expect = 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / (link.line_gbps * link.efficiency * 1e3) \
            + 2 * (n - 1) * link.step_latency_us
        assert math.isclose(r.per_call_us, expect, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(r.per_step_ms, 2 * 78 * expect / 1e3, rel_tol=1e-12, abs_tol=1e-12)
    assert (df.kind == arm.MODEL_LABEL).all() and "MODEL" in arm.MODEL_LABEL
    nv = df[(df.link == "nvlink_h200") & (df.gpus == 8)].set_index("batch").per_step_ms
    pc = df[(df.link == "pcie5_rtxpro6000") & (df.gpus == 8)].set_index("batch").per_step_ms
    assert nv.is_monotonic_increasing and (pc > nv).all()
    a = arm.assumptions()
    assert {"published", "assumption"} <= set(a.kind) and a.source.str.len().min() > 10

    paths = arm.write_results(tmp_path / "tp")
    written = pd.read_csv(paths["csv"])
    assert (written.kind == arm.MODEL_LABEL).all() and written.command.str.contains("MODEL, not measured").all()
    assert {"git_sha", "timestamp", "gpu"} <= set(pd.read_csv(paths["assumptions"]))
    assert paths["png"].stat().st_size > 1000


def test_measured_vs_model_keeps_them_apart_and_never_raises(tmp_path):
    assert arm.TP_SUITE == tp.SUITE
    view = arm.measured_vs_model(tmp_path)                                  # nothing measured yet
    assert view.measured.empty and view.slice_projection.empty and not view.model.empty
    rows = []
    for B, per_call in ((1, 20.0), (64, 30.0)):                             # as an x8 device run writes them
        for metric, value in (("allreduce_isolated_time", per_call), ("allreduce_share", 0.2),
                              ("step_time", 400.0), ("allreduce_time", 2 * per_call)):
            rows.append({"suite": tp.SUITE, "implementation": "glm5lab", "shape": f"H8_B{B}_L4096",
                         "layout": "nvidia-h200-x8:tp8:world8", "metric": metric, "value": value,
                         "gpu": "NVIDIA H200"})
    # the single-GPU run: one TP8 slice (world 1) and the 64-head layer; not a measurement of communication
    one = {"suite": tp.SUITE, "implementation": "glm5lab", "gpu": "NVIDIA H200"}
    rows += [{**one, "shape": "H8_B64_L4096", "layout": "nvidia-h200:tp8:world1", "metric": "compute_time",
              "value": 150.0},
             {**one, "shape": "H8_B64_L4096", "layout": "nvidia-h200:tp8:world1", "metric": "allreduce_isolated_time",
              "value": 5.0},
             {**one, "shape": "H64_B64_L4096", "layout": "nvidia-h200:tp1:world1", "metric": "step_time",
              "value": 900.0},
             {**one, "shape": "H8_B64_L4096", "layout": "cpu-gloo:tp2:world2", "metric": "step_time",
              "value": 1.0, "gpu": "no GPU"}]                                   # CPU rows are never inputs
    (tmp_path / "tp").mkdir(exist_ok=True)
    pd.DataFrame(rows).to_csv(tmp_path / "tp" / "tp_attention_stack.csv", index=False)
    view = arm.measured_vs_model(tmp_path)
    assert set(view.measured.kind) == {"MEASURED"} and set(view.measured.layout) == {"nvidia-h200-x8:tp8:world8"}
    assert sorted(view.measured.per_step_ms) == pytest.approx([20.0 * 156 / 1e3, 30.0 * 156 / 1e3])
    assert (view.model.kind == arm.MODEL_LABEL).all()
    sp = view.slice_projection
    assert len(sp) == 1 and sp.kind.iloc[0].startswith("PROJECTION")
    bw, lat = arm.allreduce_time_us(64 * 6144 * 2, 8, arm.links()["nvlink_h200"])
    assert sp.projected_tp_step_us.iloc[0] == pytest.approx(150.0 + 2 * (bw + lat))
    assert sp.projected_speedup_vs_1gpu.iloc[0] == pytest.approx(900.0 / (150.0 + 2 * (bw + lat)))
    assert (tmp_path / "tp" / "allreduce_measured_vs_model.png").exists()
