"""glm5lab's DSA indexer as vLLM's out-of-tree `SparseAttnIndexer`, used only where vLLM's own cannot run.

The hook (vLLM 0.32): `vllm.model_executor.models.deepseek_v2.Indexer` of vLLM's generic DSA model (GLM-5 and
DeepSeek-V3.2 share it; vLLM builds GLM-5 from it on CPU and XPU, and on CUDA where `dsa_model` routes it there)
builds `SparseAttnIndexer(...)`, a `CustomOp` registered as "sparse_attn_indexer". `CustomOp.__new__`
instantiates `op_registry_oot[<class name>]` instead when one is registered, which is what
`CustomOp.register_oot(name="SparseAttnIndexer")` does. vLLM's own op then never runs for that layer.

Where vLLM's own path cannot run (`vllm_indexer_blocker()`):
  * CUDA: `SparseAttnIndexer.__init__` raises without DeepGEMM, and DeepGEMM's fp8 (paged) MQA-logits kernels,
    which vLLM calls unchecked, exist for SM90, SM100 and SM120 (the GPUs `CudaPlatform.support_deep_gemm()`
    names), so SM80 / SM86 / SM89 have no indexer. The seed story's vLLM had no SM120 kernels; 0.32's code takes
    SM120 into its DeepGEMM path (DeepGEMM #324 added the kernels), so on SM120 vLLM's own indexer runs (not run
    here: no GPU with vLLM).
  * On CUDA vLLM 0.32 builds GLM-5 from `vllm.models.deepseek_v32.nvidia`, whose attention calls vLLM's indexer
    function directly, not this op: where this op serves, `glm5lab.vllm_plugin.dsa_model` builds vLLM's generic
    DSA model instead, whose indexer is the hook above.
  * CPU: `forward_cpu` serves only DeepSeek-V4 (keys inserted by the attention layer, index_topk == 512);
    GLM-5 inserts its own keys (skip_k_cache_insert=False) and uses index_topk 2048 -> NotImplementedError.
Elsewhere (SM90 / SM100 / SM120 with DeepGEMM, ROCm, XPU) nothing is registered, and an instance whose features
glm5lab does not implement (fp4 cache, compressed / candidate-block DSA of DeepSeek-V4.x, context
parallelism) is handed back to vLLM's own code, with the reason logged.

What glm5lab's op does per step (same contract as vLLM's `sparse_attn_indexer`): store this step's
keys into the index-key cache in vLLM's fp8 layout, compute logits for prefill rows (against the
gathered keys of their request, `indexer_logits_prefill`) and decode rows (against the paged cache,
`indexer_logits_decode`), and write the top-k request-local positions (-1 padded) into
`topk_indices_buffer`. Triton on a GPU or under TRITON_INTERPRET=1; on a CPU without the interpreter a
torch path of the same computation ("glm5lab-torch").
"""
from __future__ import annotations

import logging

import torch

from glm5lab.env import interpreter_mode
from glm5lab.vllm_plugin import ledger
from glm5lab.vllm_plugin.ledger import Patch

logger = logging.getLogger("glm5lab.vllm_plugin")

OOT_NAME = "SparseAttnIndexer"
PATCH_NAME = "DSA indexer op (SparseAttnIndexer OOT)"
VLLM_VERSIONS = {"vllm": ("0.32.0",)}


# ------------------------------------------------------------------------------------------- decision
def vllm_indexer_blocker() -> str | None:
    """Why vLLM's own sparse-attention indexer cannot run on this platform; None when it can."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return ("vLLM 0.32's CPU indexer (SparseAttnIndexer.forward_cpu) serves only DeepSeek-V4 "
                "(skip_k_cache_insert=True, index_topk == 512); GLM-5/DeepSeek-V3.2 insert their own "
                "keys and use index_topk 2048")
    if current_platform.is_cuda():
        from vllm.utils.import_utils import has_deep_gemm

        cap = current_platform.get_device_capability()
        cap_s = f"{cap.major}.{cap.minor}" if cap is not None else "unknown"
        if not has_deep_gemm():
            return (f"DeepGEMM is not installed (vLLM's CUDA indexer needs its fp8 MQA-logits kernels); "
                    f"GPU capability {cap_s}")
        # vLLM's indexer calls DeepGEMM's fp8 (paged) MQA-logits kernels without checking the GPU; they exist for
        # SM90, the SM100 family and the SM120 family (DeepGEMM #324 added SM120's), the GPUs vLLM's own
        # CudaPlatform.support_deep_gemm() names: asked here, so that a vLLM upgrade moves the line here too
        supported = getattr(current_platform, "support_deep_gemm", None)
        runs = supported() if supported is not None else (cap is not None and cap.major in (9, 10, 12))
        if cap is None or not runs:
            return (f"DeepGEMM's fp8 MQA-logits kernels, which vLLM's CUDA indexer calls, exist for SM90, SM100 and "
                    f"SM120 only (the GPUs CudaPlatform.support_deep_gemm names); this GPU has capability {cap_s}")
        return None
    return None  # ROCm / XPU / TPU: vLLM has its own paths there


def instance_blocker(**kw) -> str | None:
    """Features of one SparseAttnIndexer instance that glm5lab does not implement (-> vLLM's own)."""
    if kw.get("use_fp4_cache"):
        return "fp4 index-key cache"
    if kw.get("compress_ratio", 1) != 1 or kw.get("candidate_blocks") is not None:
        return "compressed / candidate-block DSA (DeepSeek-V4.x)"
    if kw.get("skip_k_cache_insert"):
        return "keys inserted by the attention layer (DeepSeek-V4 layout)"
    if kw.get("decode_context_parallel_size", 1) > 1 or kw.get("prefill_context_parallel_size", 1) > 1:
        return "context parallelism"
    return None


def compute_path(device: torch.device) -> str:
    """'triton' where Triton can run (CUDA, or the interpreter), else 'torch'."""
    if device.type == "cuda" or interpreter_mode():
        return "triton"
    return "torch"


# ------------------------------------------------------------------------------------------- one step
def _gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int):
    """The keys of these cache slots as the prefill logits take them: an fp8 cache's (values, scales) pair as
    stored (vLLM's cp_gather_indexer_k_quant_cache does the same), a plain cache's rows."""
    from glm5lab.kernels.dsa_indexer import fp8_cache_views, is_fp8_cache

    bs = kv_cache.shape[1]
    blk, off = slots // bs, slots % bs
    if is_fp8_cache(kv_cache, head_dim):
        values, scales = fp8_cache_views(kv_cache, head_dim)
        return values[blk, off], scales[blk, off]
    return kv_cache[blk, off]


def _dequant_slots(kv_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    from glm5lab.kernels.dsa_indexer import dequantize_fp8_keys

    keys = _gather_slots(kv_cache, slots, head_dim)
    return dequantize_fp8_keys(*keys) if isinstance(keys, tuple) else keys.float()


def _torch_logits_paged(q, weights, kv_cache, block_table, lengths, max_len):
    """The torch path: same math as the Triton decode kernel, row by row (CPU without the interpreter)."""
    D = q.shape[-1]
    bs = kv_cache.shape[1]
    out = torch.full((q.shape[0], max_len), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        n = int(lengths[t])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[t, pos // bs].long() * bs + pos % bs
        keys = _dequant_slots(kv_cache, slots, D)
        scores = torch.einsum("hd,sd->hs", q[t].float(), keys).relu()
        out[t, :n] = weights[t].float() @ scores
    return out


def _logits_paged(q, weights, kv_cache, block_table, lengths, max_len, path):
    if path == "torch":
        return _torch_logits_paged(q, weights, kv_cache, block_table, lengths, max_len)
    from glm5lab.kernels.dsa_indexer import indexer_logits_decode

    return indexer_logits_decode(q, weights, kv_cache, block_table, lengths.int(), max_len=max_len)


def _topk(logits, k, lengths, out, path):
    if path == "torch":
        from glm5lab.sparse.indexer_reference import indexer_topk_reference

        out.copy_(indexer_topk_reference(logits, k, lengths))
        return
    from glm5lab.kernels.dsa_indexer import indexer_topk

    indexer_topk(logits, k, lengths.int(), out=out, method=topk_method(logits))


def topk_method(logits: torch.Tensor) -> str:
    """Which top-k kernel for these logits (`dsa_indexer.fastest_topk_method`: by row count and length)."""
    from glm5lab.kernels.dsa_indexer import fastest_topk_method

    return fastest_topk_method(logits.shape[-1], logits.shape[0], logits.is_cuda)


def indexer_step(meta, kv_cache: torch.Tensor, q_quant: torch.Tensor, k: torch.Tensor | None,
                 weights: torch.Tensor, topk_tokens: int, topk_indices_buffer: torch.Tensor,
                 num_tokens: int | None = None, skip_k_cache_insert: bool = False,
                 path: str | None = None) -> torch.Tensor:
    """One indexer step given vLLM's `DeepseekV32IndexerMetadata` (or anything with its fields).

    q_quant [T, H, D] (fp8 with its scale folded into `weights`, or fp16/bf16/fp32); k [T, D] this step's
    index keys; weights [T, H] float32 with every scale folded in. Writes topk_indices_buffer[:T, :topk]
    (request-local positions, ascending, -1 padded) and returns the buffer.
    """
    from glm5lab.kernels.dsa_indexer import indexer_logits_prefill, write_index_key_cache

    path = path or compute_path(q_quant.device)
    head_dim = q_quant.shape[-1]
    slot_mapping = meta.slot_mapping
    n_tok = slot_mapping.shape[0]
    if not skip_k_cache_insert:
        write_index_key_cache(kv_cache, k[:n_tok], slot_mapping)
    T = num_tokens if num_tokens is not None else q_quant.shape[0]
    topk_indices_buffer[:T] = -1
    # the logits kernels take vLLM's e4m3 q as it is: with the fp8 keys an fp8 x fp8 dot (NOTES v58, H100, CUDA graphs:
    # decode 1.08-1.22x faster than the widened q at 1-256 rows x 4k-64k; prefill since v59, on the keys as gathered),
    # widened inside the kernel otherwise; no widening launch a step. The torch path and other q dtypes take bf16.
    wide = q_quant.dtype in (torch.float16, torch.bfloat16, torch.float32)
    q = (q_quant if wide or (path != "torch" and q_quant.dtype == torch.float8_e4m3fn)
         else q_quant.to(torch.bfloat16))
    bs = kv_cache.shape[1]

    if meta.num_prefills > 0 and meta.prefill is not None:
        for chunk in meta.prefill.chunks:
            a, b = chunk.token_start, chunk.token_end
            if b <= a:
                continue
            cu = chunk.local_cu_seq_lens if chunk.local_cu_seq_lens is not None else chunk.cu_seq_lens
            cu = cu.to(q.device).long()
            total = int(cu[-1])
            lengths = (chunk.cu_seqlen_ke - chunk.cu_seqlen_ks).long()
            out = topk_indices_buffer[a:b, :topk_tokens]
            if total == 0:
                continue
            g = torch.arange(total, device=q.device)
            req = torch.searchsorted(cu, g, right=True) - 1
            pos = g - cu[req]
            slots = chunk.block_table[req, pos // bs].long() * bs + pos % bs
            max_len = int(lengths.max())
            if path == "torch":
                from glm5lab.sparse.indexer_reference import indexer_logits_reference

                keys = _dequant_slots(kv_cache, slots, head_dim)             # [total, D] float32
                logits = torch.full((b - a, max_len), float("-inf"), device=q.device)
                for i in range(b - a):
                    s0, s1 = int(chunk.cu_seqlen_ks[i]), int(chunk.cu_seqlen_ke[i])
                    logits[i, : s1 - s0] = indexer_logits_reference(q[a + i:a + i + 1], keys[s0:s1],
                                                                    weights[a + i:a + i + 1])[0]
            else:
                logits = indexer_logits_prefill(q[a:b], weights[a:b], _gather_slots(kv_cache, slots, head_dim),
                                                chunk.cu_seqlen_ks, chunk.cu_seqlen_ke, max_len=max_len)
            _topk(logits, topk_tokens, lengths, out, path)

    if meta.num_decodes > 0 and meta.decode is not None:
        dec = meta.decode
        nd = meta.num_decode_tokens
        B = dec.block_table.shape[0] if dec.seq_lens.dim() == 1 else dec.seq_lens.shape[0]
        B = min(B, meta.num_decodes)
        if dec.requires_padding or nd % B != 0:
            raise NotImplementedError("glm5lab's DSA indexer does not handle non-uniform speculative "
                                      "decode lengths (requires_padding); run without MTP drafts")
        next_n = nd // B
        seq_lens = dec.seq_lens[:B]
        if seq_lens.dim() == 2:
            lengths = seq_lens.reshape(-1).long()
        else:
            j = torch.arange(next_n, device=seq_lens.device)
            lengths = (seq_lens.long()[:, None] - next_n + 1 + j[None, :]).reshape(-1)
        bt = dec.block_table[:B].repeat_interleave(next_n, dim=0)
        max_len = int(lengths.max())
        logits = _logits_paged(q[:nd], weights[:nd], kv_cache, bt, lengths, max_len, path)
        _topk(logits, topk_tokens, lengths, topk_indices_buffer[:nd, :topk_tokens], path)
    return topk_indices_buffer


# ------------------------------------------------------------------------------------------- vLLM op
OP_NAME = "glm5lab_sparse_attn_indexer"


def _op_impl(hidden_states: torch.Tensor, k_cache_prefix: str, kv_cache: torch.Tensor, q_quant: torch.Tensor,
             k: torch.Tensor, weights: torch.Tensor, topk_tokens: int, topk_indices_buffer: torch.Tensor,
             skip_k_cache_insert: bool) -> torch.Tensor:
    from vllm.forward_context import get_forward_context

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):      # profiling / dummy run
        return topk_indices_buffer
    return indexer_step(attn_metadata[k_cache_prefix], kv_cache, q_quant, k, weights, topk_tokens,
                        topk_indices_buffer, num_tokens=hidden_states.shape[0],
                        skip_k_cache_insert=skip_k_cache_insert)


def _op_fake(hidden_states, k_cache_prefix, kv_cache, q_quant, k, weights, topk_tokens, topk_indices_buffer,
             skip_k_cache_insert):
    return topk_indices_buffer


def _register_torch_op() -> None:
    """glm5lab's indexer as the torch op `vllm::glm5lab_sparse_attn_indexer`, registered like vLLM's own
    `vllm::sparse_attn_indexer` and listed beside it among the ops torch.compile's graph is split at, so
    the host-side work (metadata reads, lengths) stays out of compiled graphs and CUDA-graph capture,
    exactly as vLLM's own indexer does."""
    import torch

    if hasattr(torch.ops.vllm, OP_NAME):
        return
    from vllm.config.compilation import CompilationConfig
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name=OP_NAME, op_func=_op_impl,
                              mutates_args=["kv_cache", "topk_indices_buffer"], fake_impl=_op_fake)
    qualified = f"vllm::{OP_NAME}"
    if qualified not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(qualified)


# ------------------------------------------------------------------------------------------- vLLM class
_CLASS = None
_REASONS_LOGGED: set[str] = set()


def oot_class():
    """The SparseAttnIndexer subclass vLLM instantiates once registered (built lazily: imports vLLM)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    class Glm5labSparseAttnIndexer(SparseAttnIndexer):
        """vLLM's SparseAttnIndexer with glm5lab's kernels where vLLM's own cannot run."""

        def __init__(self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                     max_total_seq_len, topk_indices_buffer, skip_k_cache_insert=False,
                     use_fp4_cache=False, compress_ratio=1, candidate_blocks=None,
                     candidate_block_size=0, candidate_write=False):
            kw = dict(skip_k_cache_insert=skip_k_cache_insert, use_fp4_cache=use_fp4_cache,
                      compress_ratio=compress_ratio, candidate_blocks=candidate_blocks,
                      candidate_block_size=candidate_block_size, candidate_write=candidate_write)
            vllm_config = get_current_vllm_config()     # (as vLLM's own __init__ reads the run's settings)
            pc = vllm_config.parallel_config
            unsupported = instance_blocker(**kw, decode_context_parallel_size=pc.decode_context_parallel_size,
                                           prefill_context_parallel_size=pc.prefill_context_parallel_size)
            blocker = vllm_indexer_blocker()
            if unsupported is not None or blocker is None:
                logger.info("glm5lab: %s keeps vLLM's own indexer (%s)", getattr(k_cache, "prefix", "?"),
                            unsupported or "vLLM's path runs here")
                self.glm5lab_reason = None
                super().__init__(k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim,
                                 max_model_len, max_total_seq_len, topk_indices_buffer, **kw)
                return
            CustomOp.__init__(self)       # skips vLLM's DeepGEMM requirement, keeps its dispatch
            self.k_cache = k_cache
            self.quant_block_size = quant_block_size
            self.scale_fmt = scale_fmt
            self.topk_tokens = topk_tokens
            self.head_dim = head_dim
            self.max_model_len = max_model_len
            self.max_total_seq_len = max_total_seq_len
            self.topk_indices_buffer = topk_indices_buffer
            for key, value in kw.items():
                setattr(self, key, value)
            self.dense_mha_metadata_layer_name = ""
            self.dcp_world_size, self.dcp_rank, self.use_pcp = 1, 0, False   # (context parallelism went to vLLM)
            # read by vLLM's CUDA DSA model, which calls its own indexer function with it (dsa_model.py routes GLM-5
            # away from that model where this op serves)
            self.topk_backend = vllm_config.kernel_config.sparse_indexer_topk_backend
            self.glm5lab_reason = blocker
            # once a reason per process (GLM-5 has 78 indexer layers, all alike), each layer at debug level
            log = logger.debug if blocker in _REASONS_LOGGED else logger.warning
            _REASONS_LOGGED.add(blocker)
            log("glm5lab: DSA indexer %s (and every indexer layer alike) runs on glm5lab's kernels: %s",
                getattr(k_cache, "prefix", "?"), blocker)

        def _glm5lab_forward(self, hidden_states, q_quant, k, weights):
            import torch

            if isinstance(q_quant, tuple):
                raise NotImplementedError("glm5lab's DSA indexer takes an fp8 (not fp4) index query")
            return getattr(torch.ops.vllm, OP_NAME)(
                hidden_states, self.k_cache.prefix, self.k_cache.kv_cache, q_quant, k, weights,
                self.topk_tokens, self.topk_indices_buffer, self.skip_k_cache_insert)

        def _route(self, vllm_method, *args):
            if self.glm5lab_reason is None:
                return vllm_method(*args)
            return self._glm5lab_forward(*args)

        def forward_native(self, hidden_states, q_quant, k, weights):
            return self._route(super().forward_native, hidden_states, q_quant, k, weights)

        def forward_cuda(self, hidden_states, q_quant, k, weights):
            return self._route(super().forward_cuda, hidden_states, q_quant, k, weights)

        def forward_cpu(self, hidden_states, q_quant, k, weights):
            return self._route(super().forward_cpu, hidden_states, q_quant, k, weights)

    _register_torch_op()
    _CLASS = Glm5labSparseAttnIndexer
    return _CLASS


def _register_oot() -> None:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    cls = oot_class()
    if op_registry_oot.get(OOT_NAME) is cls:
        return
    if OOT_NAME in op_registry_oot:
        raise RuntimeError(f"another plugin already replaced {OOT_NAME}: {op_registry_oot[OOT_NAME]}")
    CustomOp.register_oot(cls, name=OOT_NAME)
    cls.name = "sparse_attn_indexer"   # keep vLLM's custom_ops switches (+/-sparse_attn_indexer) meaningful


ledger.add(Patch(
    name=PATCH_NAME,
    why="vLLM's sparse-attention indexer needs DeepGEMM's fp8 MQA-logits kernels on CUDA, which exist for "
        "SM90 / SM100 / SM120 only, and its CPU path serves only DeepSeek-V4; GLM-5 on SM80 / SM86 / SM89, on a "
        "CUDA vLLM without DeepGEMM, or on CPU has no indexer",
    how="CustomOp.register_oot(name='SparseAttnIndexer') with a subclass that runs glm5lab's Triton "
        "indexer (glm5lab.kernels.dsa_indexer) where vllm_indexer_blocker() gives a reason, and vLLM's "
        "own code everywhere else; registered only when the platform needs it. The work runs inside the "
        "torch op vllm::glm5lab_sparse_attn_indexer, appended to CompilationConfig._attention_ops (the "
        "graph-splitting ops, beside vllm::sparse_attn_indexer)",
    upstream="vLLM has no portable (non-DeepGEMM) fp8_paged_mqa_logits for CUDA; track "
             "vllm/model_executor/layers/sparse_attn_indexer.py",
    remove_when="vLLM ships an indexer path for the target GPU (e.g. a Triton/FlashInfer MQA-logits "
                "kernel for SM8x) and a CPU path for index_topk 2048",
    versions=VLLM_VERSIONS,
    apply=_register_oot,
))


def register() -> None:
    """Plugin part: register glm5lab's indexer only where vLLM's own cannot run, saying why."""
    reason = vllm_indexer_blocker()
    if reason is None:
        logger.info("glm5lab: vLLM's own DSA indexer serves this platform; glm5lab's is not registered")
        return
    ledger.apply(PATCH_NAME)
    logger.info("glm5lab: registered glm5lab's DSA indexer as %s: %s", OOT_NAME, reason)
