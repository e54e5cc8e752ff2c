"""The original deployment's move, with vLLM's own kernel: run vLLM 0.32's dense Triton MLA decode kernel
(`vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd`, the one TRITON_MLA uses) on the
virtual block table, and compare with the sparse reference (notebook 04).

vLLM is imported lazily, only inside these functions. Where the kernel cannot run (no vLLM, or a CPU
build of vLLM that switched Triton off) the functions say so as data, they do not raise.

Known behaviour of the vLLM kernel on this input (measured, see tests): a row with seq_len 0 gives NaN
(its split-merge divides 0 by 0), so a backend built on it must give empty rows a defined value itself;
glm5lab's own kernel returns 0 and lse -inf there.
"""
from __future__ import annotations

import torch

from glm5lab.errors import first_line
from glm5lab.env import interpreter_mode
from glm5lab.sparse.virtual_block_table import (
    VirtualBlockTable,
    page_size_one_view,
    virtual_block_table_from_slots,
)


def vllm_triton_decode_status() -> dict:
    """{'available': bool, 'reason': str}: can vLLM's Triton decode kernel run in this process?"""
    try:
        import vllm
        from vllm.triton_utils import HAS_TRITON
    except Exception as exc:  # not installed / broken install
        return {"available": False, "reason": f"vLLM is not importable here ({first_line(exc)})"}
    interpreting = interpreter_mode()
    if not HAS_TRITON:
        return {"available": False,
                "reason": f"vLLM {vllm.__version__} switched Triton off in this process "
                          "(vllm.triton_utils.HAS_TRITON is False: a CPU build of vLLM with a Triton that has "
                          "no CPU backend); its Triton decode kernel runs on a GPU box"}
    if not (torch.cuda.is_available() or interpreting):
        return {"available": False, "reason": "no CUDA device and TRITON_INTERPRET is not set"}
    return {"available": True, "reason": f"vLLM {vllm.__version__}, "
                                         f"{'CUDA' if torch.cuda.is_available() else 'Triton interpreter'}"}


def vllm_decode_attention_on_vbt(q: torch.Tensor, kv_cache: torch.Tensor, vbt: VirtualBlockTable,
                                 softmax_scale: float, kv_lora_rank: int = 512,
                                 num_kv_splits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `decode_attention_fwd` on a page_size=1 virtual block table, called the way TritonMLAImpl
    calls it (k buffer [slots, 1, 1, D], v buffer = the latent part, is_mla=True).
    Returns (out [T, H, kv_lora_rank] in q.dtype, lse [T, H] float32). Raises if vLLM cannot run it."""
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    view = page_size_one_view(kv_cache)                    # [slots, 1, D]
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.zeros(tokens, heads, dtype=torch.float32, device=q.device)
    attn_logits = torch.empty(tokens, heads, num_kv_splits, kv_lora_rank + 1, dtype=torch.float32,
                              device=q.device)
    decode_attention_fwd(q, view.unsqueeze(2), view[..., :kv_lora_rank], out, lse,
                         vbt.block_table.to(torch.int32).contiguous(), vbt.seq_lens.to(torch.int32),
                         attn_logits, num_kv_splits, softmax_scale, 1, is_mla=True)
    return out, lse


def compare_vllm_decode_with_reference(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                                       softmax_scale: float, kv_lora_rank: int = 512,
                                       num_kv_splits: int = 4) -> dict:
    """Run vLLM's kernel on the virtual block table built from global `slots` and compare with
    `sparse_mla_reference`. Returns a status dict ('ran' with errors, or 'skipped' with the reason)."""
    from glm5lab.sparse.reference import sparse_mla_reference

    status = vllm_triton_decode_status()
    if not status["available"]:
        return {"status": "skipped", "reason": status["reason"]}
    vbt = virtual_block_table_from_slots(slots)
    try:
        out, lse = vllm_decode_attention_on_vbt(q, kv_cache, vbt, softmax_scale, kv_lora_rank, num_kv_splits)
    except Exception as exc:  # report, don't raise: the notebook shows it
        return {"status": "failed", "reason": first_line(exc)}
    ref_out, ref_lse = sparse_mla_reference(q, kv_cache, slots, softmax_scale, kv_lora_rank)
    nonempty = (vbt.seq_lens > 0).cpu()
    out_c, lse_c = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    return {
        "status": "ran",
        "reason": status["reason"],
        "rows": int(q.shape[0]),
        "empty_rows": int((~nonempty).sum()),
        "max_abs_err_out": float((out_c[nonempty] - ref_out[nonempty]).abs().max()) if nonempty.any() else 0.0,
        "max_abs_err_lse": float((lse_c[nonempty] - ref_lse[nonempty]).abs().max()) if nonempty.any() else 0.0,
        "empty_rows_out_nan": bool(torch.isnan(out_c[~nonempty]).any()) if (~nonempty).any() else False,
    }
