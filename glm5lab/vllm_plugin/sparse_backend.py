"""`TRITON_MLA_SPARSE`: glm5lab's sparse-MLA attention backend for vLLM 0.32.

Why it exists: vLLM's sparse-MLA backends (FlashMLA, FlashInfer, FA3 sparse) each need particular GPU families
and usually bf16, so GLM-5 (DSA sparse attention, qk_nope_head_dim 192) has no backend on SM120 with an
fp16 GGUF model, on SM80/SM86/SM89, or on CPU. This backend runs wherever glm5lab's Triton kernel runs:
any compute capability, fp16 or bf16, KV cache `auto` (fp16/bf16 rows of 576) or `fp8_ds_mla` (656-byte
rows), GLM-5 (qk_nope 192) and DeepSeek-V3.2 (qk_nope 128) geometry.

How it plugs in: registered under its own name with vLLM's `register_backend` (no installed file is
edited); users ask for it with `attention_backend="TRITON_MLA_SPARSE"` (or `--attention-backend`). Like
vLLM's XPU sparse backend it serves prefill and decode tokens alike through the absorbed-MQA path: every
token has its own top-k list, so there is no dense-MHA prefill branch to keep consistent with it.

What the impl does per forward: the DSA indexer leaves request-local top-k positions (-1 padded) in the
shared `topk_indices_buffer`; the impl turns them into global cache rows through the request block
tables (`glm5lab.sparse.virtual_block_table`) and calls `glm5lab.kernels.sparse_mla`. Without a GPU and
without `TRITON_INTERPRET=1` the same backend runs its clearly named torch path (`torch-reference`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows, flat_kv_row_view
from vllm.v1.kv_cache_interface import AttentionSpec

from glm5lab.env import interpreter_mode
from glm5lab.sparse.virtual_block_table import req_index_to_global_slots
from glm5lab.vllm_plugin.backend_enum import BACKEND_NAME

logger = init_logger(__name__)

# Geometry the kernel is written for: latent 512 + rope 64 per cache row.
KV_LORA_RANK = 512
ROPE_DIM = 64
SUPPORTED_QK_NOPE = (128, 192)  # DeepSeek-V3.2, GLM-5


# Names of the two ways forward_mqa computes attention (reported by `glm5lab generate`).
PATH_TRITON = "triton"                 # glm5lab's fused Triton kernel (GPU, or CPU under TRITON_INTERPRET=1)
PATH_TORCH = "torch-reference"         # glm5lab.sparse.reference in float32: CPU without the interpreter


def _triton_kernel():
    """glm5lab's fused kernel, or None while glm5lab.kernels.sparse_mla is not importable."""
    try:
        from glm5lab.kernels.sparse_mla import sparse_mla_attention
    except ImportError:
        return None
    return sparse_mla_attention


def attention_path(device: torch.device | str) -> str:
    """Which implementation forward_mqa uses on `device` (decided per call, not at import)."""
    triton_ok = torch.device(device).type == "cuda" or interpreter_mode()
    return PATH_TRITON if triton_ok and _triton_kernel() is not None else PATH_TORCH


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16", "fp8_ds_mla"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["TritonMLASparseImpl"]:
        return TritonMLASparseImpl

    @staticmethod
    def get_builder_cls() -> type["TritonMLASparseMetadataBuilder"]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The kernel reads single rows through global slot indices: any page size works.
        return [MultipleOf(1)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        # Rows are addressed flat (block * block_stride_rows + offset), so blocks must be whole rows apart.
        return align_blocks_to_rows(spec)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [KV_LORA_RANK + ROPE_DIM]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return True  # wherever Triton runs

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        """A 16-bit cache in the model's dtype (the kernel reads q and the cache in one dtype), and the model's own
        geometry, read from the current vLLM config when there is one."""
        cache_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(kv_cache_dtype)
        if cache_dtype is not None and dtype is not None and cache_dtype != dtype:
            return (f"a {kv_cache_dtype} KV cache needs a {kv_cache_dtype} model, got {dtype}: use "
                    "--kv-cache-dtype auto or fp8_ds_mla, or --dtype " + kv_cache_dtype)
        try:
            model_config = get_current_vllm_config().model_config
        except Exception:  # no current config (a bare selector query): head_size was already checked
            model_config = None
        if model_config is None:
            return None
        return geometry_problem(model_config.hf_text_config)


def geometry_problem(hf_config) -> str | None:
    """One line saying why this MLA geometry is not served, or None when it is."""
    kv_lora = getattr(hf_config, "kv_lora_rank", None)
    rope = getattr(hf_config, "qk_rope_head_dim", None)
    nope = getattr(hf_config, "qk_nope_head_dim", None)
    if kv_lora != KV_LORA_RANK or rope != ROPE_DIM:
        return (f"{BACKEND_NAME} needs kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim {ROPE_DIM}, "
                f"model has {kv_lora} + {rope}")
    if nope not in SUPPORTED_QK_NOPE:
        return (f"{BACKEND_NAME} serves qk_nope_head_dim {SUPPORTED_QK_NOPE} (DeepSeek-V3.2, GLM-5), "
                f"model has {nope}")
    if getattr(hf_config, "index_topk", None) is None:
        return f"{BACKEND_NAME} is a sparse (DSA) backend; the model config has no index_topk"
    return None


@dataclass
class TritonMLASparseMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor          # [num_reqs, max_blocks] int32
    req_id_per_token: torch.Tensor     # [num_actual_tokens] int32
    query_positions: torch.Tensor      # [num_actual_tokens] int32: each token's position in its request
    num_decode_reqs: int               # requests with one query token in this step
    num_prefill_reqs: int              # requests with several (prefill or chunked prefill)
    block_size: int
    topk_tokens: int
    # Read by vLLM's shared MLA layer for every MLA metadata. All tokens are routed through the top-k
    # MQA path ("decode" in the layer's vocabulary), so the dense-MHA prefill branch never runs.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    prefill: None = None
    decode: None = None


class TritonMLASparseMetadataBuilder(AttentionMetadataBuilder[TritonMLASparseMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = int(vllm_config.model_config.hf_text_config.index_topk)
        self.req_id_per_token_buffer = torch.zeros(
            (vllm_config.scheduler_config.max_num_batched_tokens,), dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TritonMLASparseMetadata:
        cm = common_attn_metadata
        num_tokens = cm.num_actual_tokens
        starts = np.asarray(cm.query_start_loc_cpu, dtype=np.int64)
        req_ids = np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts))
        buf = self.req_id_per_token_buffer
        buf.zero_()
        buf[: req_ids.shape[0]].copy_(torch.from_numpy(req_ids), non_blocking=True)
        # Position of each token in its request: tokens already in the cache + offset in this step.
        n = cm.num_reqs
        qsl = cm.query_start_loc[: n + 1].long()
        computed = cm.seq_lens[:n].long() - (qsl[1:] - qsl[:-1])
        req = buf[:num_tokens].long()
        query_positions = (computed[req] + torch.arange(num_tokens, device=req.device) - qsl[req]).to(torch.int32)
        return TritonMLASparseMetadata(
            num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_actual_tokens=num_tokens, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens[:n],
            slot_mapping=cm.slot_mapping, block_table=cm.block_table_tensor[:n],
            req_id_per_token=buf[:num_tokens], query_positions=query_positions,
            num_decode_reqs=int((np.diff(starts) == 1).sum()),
            num_prefill_reqs=int((np.diff(starts) > 1).sum()),
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=cm.num_reqs, num_prefills=0, num_decode_tokens=num_tokens)


def _sparse_attention(q: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor, scale: float,
                      kv_lora_rank: int, path: str) -> torch.Tensor:
    """[T, H, 576] x rows -> [T, H, kv_lora_rank] in q's dtype, through the chosen path."""
    if path == PATH_TRITON:
        out, _ = _triton_kernel()(q, kv_rows, slots.to(torch.int32), scale, kv_lora_rank=kv_lora_rank)
        return out.to(q.dtype)
    from glm5lab.sparse.reference import sparse_mla_reference

    if kv_rows.dtype == torch.uint8:
        from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla

        kv_rows = dequantize_fp8_ds_mla(kv_rows)
    out, _ = sparse_mla_reference(q, kv_rows, slots, scale, kv_lora_rank=kv_lora_rank,
                                  compute_dtype=torch.float32)
    return out.to(q.dtype)


class TritonMLASparseImpl(MLAAttentionImpl[TritonMLASparseMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    supports_dense_mha_prefill = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, topk_indices_buffer: torch.Tensor | None = None,
                 indexer=None, index_group_builder=None, **mla_args) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        self.qk_nope_head_dim = mla_args.get("qk_nope_head_dim")
        if sliding_window is not None or logits_soft_cap is not None or alibi_slopes is not None:
            raise NotImplementedError(f"{BACKEND_NAME} has no sliding window, soft cap or ALiBi")
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        self.last_path: str | None = None
        self.mixed_batches = 0   # forwards whose batch held decode and prefill tokens together

    def record_logical_topk_ready(self) -> None:
        """vLLM's MLA layer calls this after the indexer ran; index groups (top-k shared between
        layers) are not used by this backend, so there is nothing to record."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: TritonMLASparseMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_tokens = q.shape[0]
        assert self.topk_indices_buffer is not None, "sparse MLA needs the indexer's top-k buffer"
        topk = self.topk_indices_buffer[:num_tokens, : attn_metadata.topk_tokens]
        kv_rows, block_stride_rows = flat_kv_row_view(kv_c_and_k_pe_cache, attn_metadata.block_size)
        # Request-local top-k -> global rows of the flat view; -1 stays -1, and so does any index past
        # the request's length or after the token's own position (causal guard).
        slots = req_index_to_global_slots(
            topk, attn_metadata.req_id_per_token[:num_tokens], attn_metadata.block_table,
            attn_metadata.block_size, seq_lens=attn_metadata.seq_lens,
            query_positions=attn_metadata.query_positions[:num_tokens],
            block_stride_rows=block_stride_rows)
        path = attention_path(q.device)
        self.last_path = path
        if getattr(attn_metadata, "num_decode_reqs", 0) and getattr(attn_metadata, "num_prefill_reqs", 0):
            self.mixed_batches += 1
        out = _sparse_attention(q, kv_rows, slots, self.scale, self.kv_lora_rank, path)
        return out, None

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """vLLM's cache writer on GPUs; on CPU (whose vLLM build has only concat_and_cache_mla_cpu, for 16-bit rows)
        the same rows written in torch, fp8_ds_mla rows quantized by glm5lab's writer of that layout."""
        if kv_cache.numel() == 0:
            return
        if kv_cache.device.type != "cpu":
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
            return
        write_mla_cache_torch(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype)


def write_mla_cache_torch(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_cache_dtype: str) -> None:
    """Store [latent | rope] rows at global slots (block * block_size + offset; -1 = skip) of a paged
    MLA cache [blocks, block_size, W], whatever the stride between blocks."""
    block_size = kv_cache.shape[1]
    rows, block_stride_rows = flat_kv_row_view(kv_cache, block_size)
    slots = slot_mapping.flatten().long()
    n = slots.shape[0]
    keep = slots >= 0
    slots = slots[keep]
    target = slots // block_size * block_stride_rows + slots % block_size
    new = torch.cat([kv_c_normed[:n].reshape(n, -1), k_pe[:n].reshape(n, -1)], dim=-1)[keep]
    if kv_cache_dtype == "fp8_ds_mla":
        from glm5lab.kernels.fp8_ds_mla import quantize_fp8_ds_mla

        rows[target] = quantize_fp8_ds_mla(new)
    else:
        rows[target] = new.to(rows.dtype)


def cuda_platform_for(capability: tuple[int, int] | str):
    """vLLM's own CUDA platform class with its device capability pinned to `capability`, usable on a
    machine without a GPU, so `get_attn_backend_cls` / `get_valid_backends` answer for any target GPU.

    vllm.platforms.cuda imports `vllm._C_stable_libtorch` only to register CUDA ops (absent from the CPU
    wheel); the selector logic needs none of them, so a placeholder module stands in for that import
    when the real one is missing.
    """
    import importlib
    import sys
    import types

    from vllm.platforms.interface import DeviceCapability

    if isinstance(capability, str):
        major, minor = (int(x) for x in capability.split("."))
    else:
        major, minor = capability
    try:
        cuda = importlib.import_module("vllm.platforms.cuda")
    except ImportError:
        sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
        cuda = importlib.import_module("vllm.platforms.cuda")
    cap = DeviceCapability(major, minor)
    return type(f"CudaPlatformSM{major}{minor}", (cuda.CudaPlatform,),
                {"get_device_capability": classmethod(lambda cls, device_id=0: cap)})


def select_backend(capability, dtype: torch.dtype = torch.float16, kv_cache_dtype: str = "auto",
                   requested: str | None = BACKEND_NAME, use_sparse: bool = True, head_size: int = 576,
                   num_heads: int = 64, block_size: int | None = None) -> dict:
    """Ask vLLM's CUDA selector which MLA backend it uses for this target; never raises for a refusal.

    Returns {"backend": class name or None, "path": qualified class path or None, "reason": vLLM's
    message when it refuses or None}. `requested=None` lets vLLM choose by its priority list.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    platform = cuda_platform_for(capability)
    cfg = AttentionSelectorConfig(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                  block_size=block_size, use_mla=True, use_sparse=use_sparse)
    chosen = AttentionBackendEnum[requested] if requested else None
    try:
        path = platform.get_attn_backend_cls(chosen, cfg, num_heads=num_heads)
    except ValueError as exc:
        return {"backend": None, "path": None, "reason": str(exc)}
    return {"backend": path.rsplit(".", 1)[-1], "path": path, "reason": None}


def register() -> None:
    """Register TRITON_MLA_SPARSE with vLLM's backend registry (idempotent); on CUDA also make it vLLM's
    last-resort choice for sparse MLA."""
    from vllm.platforms import current_platform

    from glm5lab.vllm_plugin import ledger

    ledger.apply("register TRITON_MLA_SPARSE")
    ledger.apply(PICKLE_PATCH)
    if current_platform.is_cuda():
        ledger.apply(CUDA_FALLBACK_PATCH)


CUDA_FALLBACK_PATCH = "cuda: TRITON_MLA_SPARSE as last-resort MLA backend"


def _apply_cuda_fallback(cuda_module=None) -> None:
    """Append TRITON_MLA_SPARSE to the end of vLLM's CUDA MLA priority list: every backend vLLM ranks
    first still wins wherever it is valid; glm5lab's is chosen only where none is (SM120 + fp16, SM8x)."""
    import importlib

    cuda = cuda_module or importlib.import_module("vllm.platforms.cuda")
    original = cuda._get_backend_priorities
    if getattr(original, "_glm5lab_fallback", False):
        return

    def _get_backend_priorities(use_mla, *args, **kwargs):
        return last_resort_priorities(original(use_mla, *args, **kwargs), use_mla)

    _get_backend_priorities._glm5lab_fallback = True
    _get_backend_priorities._glm5lab_original = original
    cuda._get_backend_priorities = _get_backend_priorities


def last_resort_priorities(priorities, use_mla: bool) -> list:
    """vLLM's CUDA priority list as the fallback patch leaves it: for MLA, TRITON_MLA_SPARSE appended last (once).
    The doctor asks it too, to show what vLLM with this plugin does on a CUDA host from a machine without one."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    priorities = list(priorities)
    ours = AttentionBackendEnum[BACKEND_NAME]
    if use_mla and ours not in priorities:
        priorities.append(ours)
    return priorities


def _ledger_cuda_fallback():
    from glm5lab.vllm_plugin.ledger import Patch, add

    return add(Patch(
        name=CUDA_FALLBACK_PATCH,
        why="vLLM's CUDA selector only tries its own MLA backends: on SM120 with an fp16 (GGUF) model, or on "
            "SM8x, it fails with 'No valid attention backend' unless the user names TRITON_MLA_SPARSE",
        how="wrap vllm.platforms.cuda._get_backend_priorities: TRITON_MLA_SPARSE appended last for MLA, so "
            "vLLM's own backends keep priority wherever they are valid",
        upstream="vllm/platforms/cuda.py _get_backend_priorities (no hook for out-of-tree priorities)",
        remove_when="vLLM lets plugins rank out-of-tree attention backends, or ships a portable sparse-MLA "
                    "backend",
        versions={"vllm": ("0.32.0",)},
        apply=_apply_cuda_fallback,
    ))


def _apply_registration() -> None:
    from glm5lab.vllm_plugin.backend_enum import member

    member()


def _ledger_entry():
    from glm5lab.vllm_plugin.ledger import Patch, add

    return add(Patch(
        name="register TRITON_MLA_SPARSE",
        why="vLLM 0.32 has no sparse-MLA backend for GLM-5 on SM80 / SM86 / SM89, on SM120 in fp16, or on CPU "
            "(the doctor's matrix has every capability x dtype x KV cache)",
        how="vllm.v1.attention.backends.registry.register_backend('TRITON_MLA_SPARSE', "
            "'glm5lab.vllm_plugin.sparse_backend.TritonMLASparseBackend'): vLLM's own out-of-tree hook",
        upstream="none (out-of-tree backend)",
        remove_when="never for the registration; re-test the backend API (AttentionBackend, "
                    "MLAAttentionImpl.forward_mqa, SharedTopkIndicesBuffer) on each vLLM upgrade",
        versions={"vllm": ("0.32.0",)},
        apply=_apply_registration,
    ))


PICKLE_PATCH = "spawned processes: TRITON_MLA_SPARSE unpickles by registering itself"


def _ledger_pickle_entry():
    from glm5lab.vllm_plugin.ledger import Patch, add

    return add(Patch(
        name=PICKLE_PATCH,
        why="a member added to AttentionBackendEnum at run time pickles as AttentionBackendEnum(value); vLLM's "
            "engine core (`vllm serve`; spawned always on CPU) unpickles its config before loading plugins, so it "
            "died with \"'...TritonMLASparseBackend' is not a valid AttentionBackendEnum\"",
        how="the TRITON_MLA_SPARSE member (only it) gets an instance __reduce_ex__ that pickles it as a call to "
            "glm5lab.vllm_plugin.backend_enum.member, which registers it in the unpickling process first "
            "(set by backend_enum.member with the registration; this entry records it)",
        upstream="vllm/v1/attention/backends/registry.py: AttentionBackendEnum.register adds members at run time "
                 "with no pickling support (no upstream issue found)",
        remove_when="vLLM pickles dynamic backend members by name with a hook that loads plugins, or loads "
                    "general plugins before unpickling the engine config",
        versions={"vllm": ("0.32.0",)},
    ))


_ledger_entry()
_ledger_pickle_entry()
_ledger_cuda_fallback()
