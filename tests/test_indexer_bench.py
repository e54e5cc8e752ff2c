"""The indexer benchmark's rows: what it times it also checks (the step's top-k against the torch logits, the e4m3 q's
logits against the widened q's). On the CPU under the interpreter (never speed), on a GPU at one GLM-5 shape."""
import pandas as pd
import torch

from glm5lab.bench import indexer_bench
from glm5lab.kernels.dsa_indexer import prefill_keys_as_m_default
from glm5lab.kernels.host import cuda_capability


def test_indexer_bench_rows_check_the_step_the_e4m3_q_and_the_prefill(tmp_path, device):
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
    # the prefill chunk: both paths timed, the e4m3 q's logits agreeing with the widened q's on dequantized keys
    pre = rows[rows.metric.str.startswith("prefill_")]
    tiled = {f"glm5lab-triton{q}-tiles{n}" for q in ("", "-q8") for n in indexer_bench.PREFILL_TILES}
    if device == "cuda" and prefill_keys_as_m_default(cuda_capability(torch.device("cuda"))):
        tiled |= {"glm5lab-triton-qk", "glm5lab-triton-q8-qk"}      # (the other dot order, beside the default)
    assert set(pre.implementation) == {"glm5lab-triton", "glm5lab-triton-q8"} | tiled and set(pre.dtype) == {"fp8"}
    assert set(pre[pre.metric == "prefill_op_time"].implementation) == {"glm5lab-triton", "glm5lab-triton-q8"}
    assert (pre[pre.metric.isin(["prefill_logits_time", "prefill_op_time", "prefill_logits_tflops"])].value > 0).all()
    assert pre[pre.metric == "prefill_logits_match_widened"].value.tolist() == [1.0] * pre["shape"].nunique()
    table = indexer_bench.prefill_table(csv)       # (what notebook 05b shows: a shape and implementation a row)
    assert len(table) == pre["shape"].nunique() * len({"glm5lab-triton", "glm5lab-triton-q8"} | tiled)
    assert table["prefill_op_time"].notna().sum() == 2 * pre["shape"].nunique()


def test_prefill_flops_count_the_causal_pairs():
    # 3 new tokens at the end of 5 keys see 3, 4, 5 keys: 12 dots of 2 heads x 4
    assert indexer_bench.prefill_flops(3, 5, 2, 4) == 2 * 2 * 4 * 12
