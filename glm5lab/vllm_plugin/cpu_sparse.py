"""Sparse MLA (DSA models: GLM-5, DeepSeek-V3.2) on vLLM's CPU platform, through TRITON_MLA_SPARSE.

vLLM 0.32's CPU platform refuses every sparse model before any backend is asked
(`CpuPlatform.get_attn_backend_cls`: "Sparse Attention is not supported on CPU."), which is the seed
story's wall on the machine every user and CI has. These patches open exactly that path and nothing
else: each is a ledger entry (why / how / remove-when), checked against the vLLM version it was written
for, applied in memory by the plugin only when vLLM runs on the CPU platform.
"""
from __future__ import annotations

import logging

from vllm.v1.attention.backend import AttentionBackend

from glm5lab.env import interpreter_mode
from glm5lab.vllm_plugin import ledger
from glm5lab.vllm_plugin.ledger import Patch

logger = logging.getLogger("glm5lab.vllm_plugin")

VLLM_VERSIONS = {"vllm": ("0.32.0",)}

_originals: dict[str, object] = {}


def _patch_cpu_sparse_selection() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from glm5lab.vllm_plugin.sparse_backend import BACKEND_NAME, TritonMLASparseBackend, register

    original = CpuPlatform.__dict__["get_attn_backend_cls"]
    _originals["CpuPlatform.get_attn_backend_cls"] = original

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if not attn_selector_config.use_sparse:
            return original.__func__(cls, selected_backend, attn_selector_config, num_heads)
        register()
        ours = AttentionBackendEnum[BACKEND_NAME]
        if selected_backend is not None and selected_backend != ours:
            raise ValueError(
                f"Selected backend {selected_backend.name} cannot run sparse attention on CPU; "
                f"glm5lab serves sparse MLA on CPU with {BACKEND_NAME} (leave attention_backend unset "
                f"or set it to {BACKEND_NAME})")
        # A CPU has no compute capability; the backend runs wherever Triton (or its torch path) runs.
        reasons = TritonMLASparseBackend.validate_configuration(
            device_capability=DeviceCapability(0, 0), **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"{BACKEND_NAME} is not valid for this configuration on CPU. "
                             f"Reason: {reasons}")
        logger.info("glm5lab: using %s for sparse MLA on CPU", BACKEND_NAME)
        return ours.get_path()

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


ledger.add(Patch(
    name="cpu: sparse MLA backend selection",
    why="CpuPlatform.get_attn_backend_cls raises 'Sparse Attention is not supported on CPU.' for every "
        "DSA model before asking any backend",
    how="wrap CpuPlatform.get_attn_backend_cls: sparse layers get TRITON_MLA_SPARSE after vLLM's own "
        "validate_configuration; dense layers go to the original method unchanged",
    upstream="vllm/platforms/cpu.py (no sparse backend on CPU in 0.32)",
    remove_when="vLLM's CPU platform selects a sparse-MLA backend for DSA models itself",
    versions=VLLM_VERSIONS,
    apply=_patch_cpu_sparse_selection,
))

# ------------------------------------------------------------------------------------- DSA indexer
# vLLM 0.32's CPU indexer path cannot serve GLM-5: `SparseAttnIndexer.forward_cpu` is DeepSeek-V4's
# (index_topk must be 512, the key-cache insert is not implemented), the DeepseekV32 indexer metadata
# builder launches vLLM Triton kernels that the CPU build disables, and the generic `Indexer.forward`
# quantizes the index queries to fp8 with power-of-two scales (DeepGEMM's input format), which moves
# the top-k away from the model's own (transformers) selection. On CPU glm5lab therefore keeps the index
# keys in the model dtype and scores them with its own DSA indexer kernels (glm5lab.kernels.dsa_indexer,
# Triton under TRITON_INTERPRET=1, else the torch reference of the same computation).

INDEXER_PATH_TRITON = "glm5lab dsa_indexer (Triton)"
INDEXER_PATH_TORCH = "glm5lab indexer torch-reference"


def indexer_path() -> str:
    return INDEXER_PATH_TRITON if interpreter_mode() else INDEXER_PATH_TORCH


def _plain_index_head_dim(packed_width: int) -> int:
    """vLLM sizes the fp8 index-key row as D + D/128 * 4 bytes (values + one fp32 scale per 128)."""
    d = packed_width * 32 // 33
    if d + d // 128 * 4 != packed_width:
        raise ValueError(f"unexpected DSA index-key cache width {packed_width}")
    return d


class CpuDSAIndexerBackend(AttentionBackend):
    """Metadata-only backend of the index-key cache on CPU: the builder is TRITON_MLA_SPARSE's (block
    table, slot mapping, request id and position of every token), which is all the indexer needs."""

    @staticmethod
    def get_name() -> str:
        return "GLM5LAB_CPU_DSA_INDEXER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the index-key cache is read by Indexer.forward, not by an attention impl")

    @staticmethod
    def get_builder_cls():
        from glm5lab.vllm_plugin.sparse_backend import TritonMLASparseMetadataBuilder

        return TritonMLASparseMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 128]


def _patch_cpu_indexer_cache() -> None:
    import torch
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    _originals["DeepseekV32IndexerCache.get_kv_cache_spec"] = DeepseekV32IndexerCache.get_kv_cache_spec
    _originals["DeepseekV32IndexerCache.get_attn_backend"] = DeepseekV32IndexerCache.get_attn_backend

    def get_kv_cache_spec(self, vllm_config):
        head_dim = self.head_dim
        if self.dtype == torch.uint8:
            head_dim = _plain_index_head_dim(self.head_dim)
        return MLAAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=head_dim, dtype=torch.float32,
                                cache_role=SparseCacheRole.INDEXER)

    def get_attn_backend(self):
        return CpuDSAIndexerBackend

    DeepseekV32IndexerCache.get_kv_cache_spec = get_kv_cache_spec
    DeepseekV32IndexerCache.get_attn_backend = get_attn_backend


def dsa_topk(q, weights, k_cache, block_table, req_id, positions, topk: int):
    """Top-k index positions (request-local, ascending, -1 padded) of every token, prefill and decode
    alike: token t scores the keys of its request at positions 0..positions[t] (causal)."""
    import torch

    req = req_id.long()
    lens = positions.to(torch.int32) + 1
    rows_bt = block_table[req]
    if indexer_path() == INDEXER_PATH_TRITON:
        from glm5lab.kernels.dsa_indexer import indexer_logits_decode, indexer_topk

        logits = indexer_logits_decode(q, weights.float(), k_cache, rows_bt, lens)
        return indexer_topk(logits, topk, lens)
    from glm5lab.sparse.indexer_reference import indexer_topk_reference
    from glm5lab.sparse.virtual_block_table import req_index_to_global_slots

    max_len = int(lens.max()) if lens.numel() else 0
    cols = torch.arange(max_len, device=q.device, dtype=torch.int32).expand(q.shape[0], max_len)
    slots = req_index_to_global_slots(cols, req_id, block_table, k_cache.shape[1],
                                      query_positions=positions)
    flat = k_cache.reshape(-1, k_cache.shape[-1])
    keys = flat[slots.long().clamp(min=0)].float()                               # [T, L, D]
    scores = torch.einsum("thd,tld->thl", q.float(), keys).relu()
    logits = torch.einsum("th,thl->tl", weights.float(), scores)
    logits = logits.masked_fill(slots < 0, float("-inf"))
    return indexer_topk_reference(logits, topk, lens)


def _patch_cpu_indexer_forward() -> None:
    import torch
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.deepseek_v2 import Indexer

    _originals["Indexer.forward"] = Indexer.forward

    def forward(self, hidden_states, qr, positions, rotary_emb):
        q, _ = self.wq_b(qr)
        q = q.view(-1, self.n_head, self.head_dim)
        kw, _ = self.wk_weights_proj(hidden_states)
        k = self.k_norm(kw[:, : self.head_dim])
        weights = kw[:, self.head_dim:]
        q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        q = torch.cat([q_pe.reshape(-1, self.n_head, self.rope_dim), q_nope], dim=-1)
        # The index scores pick a discrete top-k: computed in float32 (as transformers does) so fp16 / bf16
        # rounding does not move a position across the k-th boundary.
        q = q.float()
        k = torch.cat([k_pe.reshape(-1, self.rope_dim), k_nope], dim=-1).float()
        # Both scales folded into the head weights (glm5lab.sparse.indexer_reference.head_weights).
        weights = weights.float() * self.softmax_scale * self.n_head_scale

        buffer = self.topk_indices_buffer
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):  # profile / dummy run
            return buffer
        md = attn_metadata[self.k_cache.prefix]
        num_tokens = md.num_actual_tokens
        from glm5lab.kernels.dsa_indexer import write_index_key_cache

        cache = self.k_cache.kv_cache
        write_index_key_cache(cache, k[:num_tokens], md.slot_mapping[:num_tokens])
        top = dsa_topk(q[:num_tokens], weights[:num_tokens], cache, md.block_table,
                       md.req_id_per_token[:num_tokens], md.query_positions, self.topk_tokens)
        buffer[:num_tokens] = -1
        buffer[:num_tokens, : top.shape[1]] = top.to(buffer.dtype)
        return buffer

    Indexer.forward = forward


ledger.add(Patch(
    name="cpu: DSA index-key cache",
    why="the DSA indexer's key cache is DeepGEMM's fp8 layout and its metadata builder runs vLLM Triton "
        "kernels the CPU build disables (TypeError 'Cannot inspect kernel parameters'); neither serves "
        "GLM-5 on CPU",
    how="DeepseekV32IndexerCache.get_kv_cache_spec -> index keys of index_head_dim in float32; "
        ".get_attn_backend -> a metadata-only backend whose builder is TRITON_MLA_SPARSE's",
    upstream="vllm/model_executor/models/deepseek_v2.py DeepseekV32IndexerCache; "
             "vllm/v1/attention/backends/mla/indexer.py",
    remove_when="vLLM's CPU platform runs the DeepSeek-V3.2/GLM-5 indexer (metadata + cache) itself",
    versions=VLLM_VERSIONS,
    apply=_patch_cpu_indexer_cache,
))

ledger.add(Patch(
    name="cpu: DSA indexer dispatch",
    why="Indexer.forward on CPU quantizes index queries to fp8 and calls SparseAttnIndexer.forward_cpu, "
        "which only serves DeepSeek-V4 (index_topk 512, no key-cache insert)",
    how="Indexer.forward on CPU: same projections, LayerNorm and rope as vLLM's, q and keys in float32 "
        "(like transformers), logits + top-k by glm5lab.kernels.dsa_indexer (or its torch reference) written to the "
        "shared topk_indices_buffer that TRITON_MLA_SPARSE reads",
    upstream="vllm/model_executor/models/deepseek_v2.py Indexer.forward; "
             "vllm/model_executor/layers/sparse_attn_indexer.py forward_cpu",
    remove_when="vLLM's CPU sparse indexer serves index_topk != 512 with a key-cache insert",
    versions=VLLM_VERSIONS,
    apply=_patch_cpu_indexer_forward,
))

# ------------------------------------------------------------------------------------- rotary embedding
def cpu_rope_kernel_is_wrong_for(query, key) -> bool:
    """Inputs on which vLLM 0.32's CPU rotary kernel (ops.rotary_embedding) gives wrong results, found by
    comparing it with RotaryEmbedding.forward_native (tests/test_vllm_generate.py): a 3-D query with more
    than one head ([T, H>1, D] rotates wrongly), or a query/key that is a strided view (MLA passes
    q[..., qk_nope:] and the k_pe slice of kv_a's output: nothing is written back, the keys stay unroped)."""
    if query.dim() == 3 and query.shape[1] > 1:
        return True
    return not query.is_contiguous() or (key is not None and not key.is_contiguous())


def _patch_cpu_rope() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    _originals["RotaryEmbedding.forward_cpu"] = original

    def forward_cpu(self, positions, query, key=None):
        if not cpu_rope_kernel_is_wrong_for(query, key):
            return original(self, positions, query, key)
        q_new, k_new = self.forward_native(positions, query, key)
        query.copy_(q_new.view_as(query))          # keep the kernel's in-place contract
        if key is not None:
            key.copy_(k_new.view_as(key))
        return query, key

    RotaryEmbedding.forward_cpu = forward_cpu


ledger.add(Patch(
    name="cpu: rotary embedding on MLA inputs",
    why="vLLM 0.32's CPU rotary kernel rotates a 3-D multi-head query wrongly and leaves strided 3-D views "
        "(MLA's q[..., qk_nope:] and k_pe slice) unrotated: an MLA model whose rope takes RotaryEmbedding's CPU "
        "kernel (GLM-5's plain rope) attends without positions (DeepSeek-V3's yarn rope has no CPU kernel and "
        "runs forward_native)",
    how="wrap RotaryEmbedding.forward_cpu: for those inputs compute forward_native and copy the result "
        "back in place (the kernel's contract); other inputs still use the CPU kernel",
    upstream="vllm/model_executor/layers/rotary_embedding/base.py forward_cpu -> csrc/cpu rotary kernel",
    remove_when="RotaryEmbedding.forward_cpu equals forward_native for [T, H>1, D] and strided inputs",
    versions=VLLM_VERSIONS,
    apply=_patch_cpu_rope,
))

CPU_PATCHES = ["cpu: sparse MLA backend selection", "cpu: DSA index-key cache", "cpu: DSA indexer dispatch",
               "cpu: rotary embedding on MLA inputs"]


def register() -> None:
    """Plugin part: apply the CPU patches when vLLM runs on its CPU platform (no-op elsewhere)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name in CPU_PATCHES:
        ledger.apply(name)
