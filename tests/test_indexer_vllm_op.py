"""glm5lab's DSA indexer as vLLM 0.32's out-of-tree SparseAttnIndexer: where it registers, that vLLM then
builds it, and that one step driven by vLLM's own indexer metadata classes (decode + prefill rows mixed,
fp8 index-key cache in vLLM's layout, fp8 queries with the scale folded into the weights) gives the
reference top-k, up to ties within the logits tolerance."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from glm5lab.kernels.dsa_indexer import dequantize_index_key_cache, write_index_key_cache  # noqa: E402
from glm5lab.sparse.indexer_reference import (indexer_logits_reference,  # noqa: E402
                                              topk_sets_agree)
from glm5lab.vllm_plugin import indexer_op  # noqa: E402

PREFIX = "model.layers.0.self_attn.indexer.k_cache"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
H, D, PAGE, TOPK = 4, 128, 16, 12


def test_blocker_names_the_cpu_reason_here():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("this checks the CPU platform's verdict")  # never reached on the CPU CI machine
    reason = indexer_op.vllm_indexer_blocker()
    assert reason is not None and "CPU" in reason and "2048" in reason


@pytest.mark.parametrize("cap, deep_gemm, blocked", [
    ((12, 0), True, False), ((9, 0), True, False), ((10, 0), True, False),    # vLLM's DeepGEMM indexer runs there
    ((8, 9), True, True), ((8, 0), True, True),                              # no MQA-logits kernels for SM8x
    ((12, 0), False, True)])                                                  # a CUDA vLLM without DeepGEMM
def test_blocker_on_cuda_follows_vllms_own_deep_gemm_predicate(monkeypatch, cap, deep_gemm, blocked):
    """On CUDA glm5lab replaces vLLM's indexer only where vLLM cannot run it: no DeepGEMM, or a GPU that vLLM's
    CudaPlatform.support_deep_gemm() leaves out. vLLM 0.32 runs DeepGEMM's MQA-logits kernels on SM120 (its
    vendored DeepGEMM has them), so SM120 keeps vLLM's own indexer (glm5lab took it over before)."""
    from tests.vllm_fakes import fake_cuda

    fake_cuda(monkeypatch, cap, deep_gemm)
    reason = indexer_op.vllm_indexer_blocker()
    assert (reason is not None) == blocked, reason
    if blocked:
        assert f"{cap[0]}.{cap[1]}" in reason and ("DeepGEMM is not installed" in reason) == (not deep_gemm)


def test_instances_glm5lab_does_not_implement_go_to_vllms_op():
    """What one indexer instance asks that glm5lab's op does not do is handed to vLLM's own op, with the reason."""
    assert indexer_op.instance_blocker(skip_k_cache_insert=False, decode_context_parallel_size=1,
                                       prefill_context_parallel_size=1) is None
    for kw, reason in (({"use_fp4_cache": True}, "fp4 index-key cache"),
                       ({"compress_ratio": 4}, "compressed / candidate-block DSA (DeepSeek-V4.x)"),
                       ({"skip_k_cache_insert": True}, "keys inserted by the attention layer (DeepSeek-V4 layout)"),
                       ({"decode_context_parallel_size": 2}, "context parallelism"),
                       ({"prefill_context_parallel_size": 2}, "context parallelism")):
        assert indexer_op.instance_blocker(**kw) == reason, kw


def test_register_follows_the_blocker_and_the_oot_hook_is_vllms(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    from glm5lab.vllm_plugin import PARTS, ledger

    assert ("glm5lab.vllm_plugin.indexer_op", "register") in PARTS
    # from a process where nothing registered it yet (other tests apply the patch; monkeypatch restores both)
    monkeypatch.setattr(ledger, "APPLIED", set())
    monkeypatch.delitem(op_registry_oot, indexer_op.OOT_NAME, raising=False)
    reason = indexer_op.vllm_indexer_blocker()
    indexer_op.register()
    first = (set(ledger.APPLIED), dict(op_registry_oot))
    indexer_op.register()                       # idempotent: the same state after a second call
    assert (set(ledger.APPLIED), dict(op_registry_oot)) == first
    if reason is not None:                      # this platform needs glm5lab's indexer
        assert indexer_op.PATCH_NAME in ledger.APPLIED
        assert op_registry_oot[indexer_op.OOT_NAME] is indexer_op.oot_class()
    else:                                       # vLLM's own indexer serves it: nothing registered
        assert indexer_op.PATCH_NAME not in ledger.APPLIED and indexer_op.OOT_NAME not in op_registry_oot
    ledger.apply(indexer_op.PATCH_NAME)         # the mechanism itself, on any platform
    cls = op_registry_oot[indexer_op.OOT_NAME]
    assert cls is indexer_op.oot_class()
    assert cls.name == "sparse_attn_indexer"
    row = [r for r in ledger.as_rows() if r["patch"] == indexer_op.PATCH_NAME][0]
    assert row["applied"] and "vllm 0.32.0" in row["versions"]
    # the work runs in a torch op that torch.compile splits the graph at, like vLLM's own indexer op
    from vllm.config.compilation import CompilationConfig

    assert hasattr(torch.ops.vllm, indexer_op.OP_NAME)
    assert f"vllm::{indexer_op.OP_NAME}" in CompilationConfig._attention_ops
    assert "vllm::sparse_attn_indexer" in CompilationConfig._attention_ops


def _vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig())


@pytest.fixture
def glm5lab_path(monkeypatch):
    """Make glm5lab's path the one taken on any platform (the H200 run has vLLM's own path)."""
    from glm5lab.vllm_plugin import ledger

    ledger.apply(indexer_op.PATCH_NAME)
    reason = indexer_op.vllm_indexer_blocker() or "test: forced"
    monkeypatch.setattr(indexer_op, "vllm_indexer_blocker", lambda: reason)
    return reason


def test_vllm_instantiates_glm5lab_class_and_hands_back_unsupported_features(glm5lab_path):
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    kc = SimpleNamespace(prefix=PREFIX, kv_cache=torch.zeros(2, PAGE, D + 4, dtype=torch.uint8))
    buf = torch.zeros(4, TOPK, dtype=torch.int32)
    with _vllm_config():
        ours = SparseAttnIndexer(kc, 128, "ue8m0", TOPK, D, 256, 256, buf)
        assert type(ours) is indexer_op.oot_class()
        assert ours.glm5lab_reason == glm5lab_path
        try:   # fp4 cache: glm5lab hands the instance back to vLLM's own code
            theirs = SparseAttnIndexer(kc, 128, "ue8m0", TOPK, D, 256, 256, buf, use_fp4_cache=True)
        except RuntimeError as exc:             # vLLM's own __init__ on CUDA without DeepGEMM
            assert "DeepGEMM" in str(exc)
        else:
            assert theirs.glm5lab_reason is None


def test_the_reason_is_logged_once_not_once_a_layer(glm5lab_path, monkeypatch, caplog):
    """GLM-5 builds 78 indexer layers: one warning names the reason, the others go to debug."""
    import logging

    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    monkeypatch.setattr(indexer_op, "_REASONS_LOGGED", set())
    buf = torch.zeros(4, TOPK, dtype=torch.int32)
    with _vllm_config(), caplog.at_level(logging.DEBUG, logger="glm5lab.vllm_plugin"):
        for layer in range(3):
            kc = SimpleNamespace(prefix=f"model.layers.{layer}.indexer.k_cache",
                                 kv_cache=torch.zeros(2, PAGE, D + 4, dtype=torch.uint8))
            SparseAttnIndexer(kc, 128, "ue8m0", TOPK, D, 256, 256, buf)
    ours = [r for r in caplog.records if "runs on glm5lab's kernels" in r.getMessage()]
    assert [r.levelno for r in ours] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert glm5lab_path in ours[0].getMessage() and "layers.0" in ours[0].getMessage()


def _quant_q_like_vllm(q: torch.Tensor):
    """vLLM's Indexer.forward: per-(token, head) fp8 e4m3 with a power-of-two scale (group = head_dim)."""
    amax = q.abs().amax(dim=-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (q / scale[..., None]).to(torch.float8_e4m3fn), scale


def _scenario(seed=0, device="cpu"):
    """Two decode requests (contexts 40 and 17) and two prefill requests in one chunk (10 new tokens after
    15 cached; 6 new tokens from scratch), in vLLM's token order (decodes first). The second prefill
    request's keys start at 25 in the chunk's gathered keys, so its top-k must be shifted back to
    request-local positions."""
    from vllm.v1.attention.backends.mla.indexer import (DeepseekV32IndexerMetadata,
                                                        DeepseekV32IndexerPrefillChunkMetadata,
                                                        DeepseekV32IndexerPrefillMetadata,
                                                        DeepSeekV32IndexerDecodeMetadata)

    gen = torch.Generator().manual_seed(seed)
    ctx = [40, 17, 25, 6]
    new = [1, 1, 10, 6]
    num_blocks = 14
    cache = torch.zeros(num_blocks, PAGE, D + 4, dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.stack([perm[0:3], perm[3:6], perm[6:9], perm[9:12]]).int()   # 3 pages each (48 slots)
    keys = [torch.randn(n, D, generator=gen) for n in ctx]                   # every position's index key

    def slots(r, pos):
        return bt[r, pos // PAGE].long() * PAGE + pos % PAGE

    for r in range(4):                                                       # history already cached
        old = torch.arange(ctx[r] - new[r])
        write_index_key_cache(cache, keys[r][old], slots(r, old))
    step_pos = [torch.arange(ctx[r] - new[r], ctx[r]) for r in range(4)]
    slot_mapping = torch.cat([slots(r, step_pos[r]) for r in range(4)])
    k_step = torch.cat([keys[r][step_pos[r]] for r in range(4)]).bfloat16()
    T = sum(new)
    q = torch.randn(T, H, D, generator=gen)
    q_fp8, q_scale = _quant_q_like_vllm(q)
    w = torch.randn(T, H, generator=gen) / H
    weights = (w * q_scale).float()                                            # vLLM folds q's scale in
    ks = torch.cat([torch.zeros(10), torch.full((6,), 25)]).int()
    ke = torch.cat([step_pos[2] + 1, 25 + step_pos[3] + 1]).int()
    chunk = DeepseekV32IndexerPrefillChunkMetadata(
        block_table=bt[2:4], cu_seqlen_ks=ks, cu_seqlen_ke=ke,
        cu_seq_lens=torch.tensor([0, 25, 31], dtype=torch.int32),
        token_to_seq=torch.tensor([0] * 10 + [1] * 6, dtype=torch.int32), total_seq_lens=31,
        token_start=2, token_end=18, num_reqs=2)
    meta = DeepseekV32IndexerMetadata(
        seq_lens=torch.tensor(ctx, dtype=torch.int32), max_seq_len=40, slot_mapping=slot_mapping,
        num_decodes=2, num_decode_tokens=2, num_prefills=2, num_prefill_tokens=16,
        decode=DeepSeekV32IndexerDecodeMetadata(block_table=bt[:2], seq_lens=torch.tensor([40, 17], dtype=torch.int32),
                                                decode_lens=torch.ones(2, dtype=torch.int32), requires_padding=False,
                                                schedule_metadata=torch.empty(0)),
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]))
    token_req = [0, 1] + [2] * 10 + [3] * 6
    token_len = [40, 17] + (step_pos[2] + 1).tolist() + (step_pos[3] + 1).tolist()
    if device != "cpu":
        for obj in (meta, meta.decode, chunk):
            for name, value in vars(obj).items():
                if isinstance(value, torch.Tensor):
                    setattr(obj, name, value.to(device))
    return dict(cache=cache.to(device), meta=meta, q_fp8=q_fp8.to(device), k=k_step.to(device),
                weights=weights.to(device), bt=bt, token_req=token_req, token_len=token_len, T=T)


def _check(buf, s, atol_rel=2e-3):
    buf = buf.cpu()
    s = {**s, "cache": s["cache"].cpu(), "q_fp8": s["q_fp8"].cpu(), "weights": s["weights"].cpu()}
    cache_after = dequantize_index_key_cache(s["cache"], D).reshape(-1, D)
    failures = []
    for t in range(s["T"]):
        r, n = s["token_req"][t], s["token_len"][t]
        pos = torch.arange(n)
        keys = cache_after[s["bt"][r, pos // PAGE].long() * PAGE + pos % PAGE]
        ref = indexer_logits_reference(s["q_fp8"][t:t + 1].float(), keys, s["weights"][t:t + 1],
                                       compute_dtype=torch.float64)
        tol = atol_rel * float(ref.abs().max())
        failures += topk_sets_agree(buf[t:t + 1, :TOPK], ref, TOPK, torch.tensor([n]), atol=tol)
        assert int((buf[t, :TOPK] >= 0).sum()) == min(n, TOPK)
    assert failures == []


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_indexer_step_matches_reference_on_vllm_metadata(path, device, monkeypatch):
    from glm5lab.kernels import dsa_indexer

    dev = device if path == "triton" else "cpu"     # Triton needs CUDA or the interpreter
    s = _scenario(seed=1, device=dev)
    buf = torch.full((24, TOPK), 777, dtype=torch.int32, device=dev)     # poisoned, bigger than the step
    decode_q, prefill_qk = [], []
    real_decode, real_prefill = dsa_indexer.indexer_logits_decode, dsa_indexer.indexer_logits_prefill
    monkeypatch.setattr(dsa_indexer, "indexer_logits_decode", lambda q, *a, **kw: decode_q.append(q.dtype) or
                        real_decode(q, *a, **kw))
    monkeypatch.setattr(dsa_indexer, "indexer_logits_prefill", lambda q, w, k, *a, **kw: prefill_qk.append(
        (q.dtype, tuple(x.dtype for x in k))) or real_prefill(q, w, k, *a, **kw))
    indexer_op.indexer_step(s["meta"], s["cache"], s["q_fp8"], s["k"], s["weights"], TOPK, buf,
                            num_tokens=s["T"], path=path)
    _check(buf, s)
    # the decode logits get vLLM's e4m3 q as it is: the fp8 x fp8 dot, no widening launch (NOTES v58); so do the
    # prefill logits, with the chunk's keys gathered as the cache stores them (e4m3 bytes, a float32 scale a key)
    assert decode_q == ([torch.float8_e4m3fn] if path == "triton" else [])
    assert prefill_qk == ([(torch.float8_e4m3fn, (torch.uint8, torch.float32))] if path == "triton" else [])
    assert (buf[s["T"]:] == 777).all()                                    # rows beyond the step untouched
    # the step's own keys went into the cache (fp8: within e4m3's relative error of 2**-4)
    stored = dequantize_index_key_cache(s["cache"], D).reshape(-1, D)[s["meta"].slot_mapping.long()]
    torch.testing.assert_close(stored.cpu(), s["k"].float().cpu(), atol=1e-2, rtol=2 ** -4)


def test_op_forward_through_vllm_class(monkeypatch, glm5lab_path, device):
    import vllm.forward_context as fc
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    s = _scenario(seed=2, device=device)
    kc = SimpleNamespace(prefix=PREFIX, kv_cache=s["cache"])
    buf = torch.full((24, TOPK), 777, dtype=torch.int32, device=device)
    with _vllm_config():
        op = SparseAttnIndexer(kc, 128, "ue8m0", TOPK, D, 256, 256, buf)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={PREFIX: s["meta"]}))
    hidden = torch.zeros(s["T"], 8, device=device)
    out = op(hidden, s["q_fp8"], s["k"], s["weights"])
    assert out is buf
    _check(buf, s)
    # profiling run (no metadata dict): the buffer comes back untouched
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata=None))
    before = buf.clone()
    assert op(hidden, s["q_fp8"], s["k"], s["weights"]) is buf and torch.equal(buf, before)
