"""The indexer benchmark's rows: what it times it also checks (the step's top-k against the torch logits, the e4m3 q's
logits against the widened q's). On the CPU under the interpreter (never speed), on a GPU at one GLM-5 shape."""
import pandas as pd

from glm5lab.bench import indexer_bench


def test_indexer_bench_rows_check_the_step_and_the_e4m3_q(tmp_path, device):
    csv = tmp_path / "indexer.csv"
    kw = dict(contexts=(64,), batches=(1, 3)) if device == "cpu" else dict(contexts=(4096,), batches=(1, 32))
    indexer_bench.run(str(csv), "cpu" if device == "cpu" else "gpu", verbose=False, **kw)
    rows = pd.read_csv(csv)
    q8 = rows[rows.implementation == "glm5lab-triton-q8"]
    # the e4m3 q is timed for the fp8 keys only (bf16 keys widen it: nothing new to time), at every shape
    assert set(q8.dtype) == {"fp8"} and q8[q8.metric == "logits_time"]["shape"].nunique() == 2
    assert (q8[q8.metric == "logits_time"].value > 0).all()
    assert (q8[q8.metric == "logits_match_widened_q"].value == 1.0).all()
    assert len(q8[q8.metric == "logits_match_widened_q"]) == 2
    triton = rows[rows.implementation == "glm5lab-triton"]
    assert (triton[triton.metric == "topk_rows_valid"].value == 1.0).all()
    assert set(triton.dtype) == {"bf16", "fp8"}
    if device == "cuda":
        assert {"logits_time_graph", "fraction_of_copy_ceiling_graph"} <= set(q8.metric)
