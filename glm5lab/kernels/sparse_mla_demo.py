"""Small, self-checking comparisons for notebook 05: the virtual-block-table route vs the fused kernel, the
-1 / empty-row convention, and the top-k split. Every function returns a DataFrame (failures as data, so a
notebook cell never raises)."""
from __future__ import annotations

import time

import torch

from glm5lab.kernels.fp8_ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from glm5lab.kernels.sparse_mla import sparse_mla_attention
from glm5lab.sparse.reference import mla_softmax_scale, sparse_mla_reference

SCALE = mla_softmax_scale(192, 64)


def random_problem(T: int, H: int, topk: int, num_slots: int, device: str, block_size: int = 64,
                   pad_fraction: float = 0.2, seed: int = 0):
    """bf16 q, bf16 paged cache, its fp8_ds_mla copy, and global slots with -1 scattered through rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_slots // block_size, block_size, 576, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, num_slots, (T, topk), generator=g, dtype=torch.int32)
    slots[torch.rand(T, topk, generator=g) < pad_fraction] = -1
    fp8 = quantize_fp8_ds_mla(kv)
    return q.to(device), kv.to(device), fp8.to(device), slots.to(device)


def _err(out, lse, ref):
    o, r = out.double().cpu(), ref[0].double().cpu()
    fin = torch.isfinite(ref[1].cpu())
    return (float((o - r).norm() / r.norm()),
            float((lse.double().cpu() - ref[1].cpu())[fin].abs().max()) if bool(fin.any()) else 0.0)


def _timed(fn, reps: int = 3):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        res = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, (time.perf_counter() - t0) / reps * 1e3


def compare_routes(T: int, H: int, topk: int, num_slots: int, device: str, seed: int = 0):
    """Reference vs the virtual-block-table route (notebook 04's dense paged kernel) vs the fused kernel in
    both layouts, on one problem. Wall-clock ms (CPU: interpreter, only for orientation)."""
    import pandas as pd

    q, kv, fp8, slots = random_problem(T, H, topk, num_slots, device, seed=seed)
    ref = sparse_mla_reference(q, kv, slots, SCALE)
    ref_fp8 = sparse_mla_reference(q, dequantize_fp8_ds_mla(fp8), slots, SCALE)
    rows = []
    routes = [("fused kernel, bf16 KV", lambda: sparse_mla_attention(q, kv, slots, SCALE), ref),
              ("fused kernel, fp8_ds_mla KV (vs dequantized)", lambda: sparse_mla_attention(q, fp8, slots, SCALE),
               ref_fp8)]
    try:
        from glm5lab.sparse.virtual_block_table import virtual_block_table_attention

        routes.insert(0, ("virtual block table + paged kernel, bf16 KV",
                          lambda: virtual_block_table_attention(q, kv, slots, SCALE, validate=False), ref))
    except ImportError as exc:
        rows.append({"route": "virtual block table + paged kernel", "note": f"not available: {exc}"})
    for name, fn, r in routes:
        try:
            (out, lse), ms = _timed(fn, reps=1 if device == "cpu" else 5)
            rel, lerr = _err(out, lse, r)
            rows.append({"route": name, "rel_err_out": rel, "max_abs_err_lse": lerr, "wall_ms": ms, "note": ""})
        except Exception as exc:  # noqa: BLE001  (shown as data)
            rows.append({"route": name, "note": f"{type(exc).__name__}: {exc}"})
    return pd.DataFrame(rows)


def padding_demo(device: str):
    """-1 anywhere in a row is skipped; a row with no valid slot gives out = 0 and lse = -inf."""
    import pandas as pd

    q, kv, _, slots = random_problem(4, 8, 16, 256, device, pad_fraction=0.0, seed=1)
    slots[0, ::2] = -1           # every other slot missing
    slots[1, :8] = -1            # first half missing
    slots[2, :] = -1             # nothing valid
    slots[3, 5] = slots[3, 4]    # a duplicate counts twice, like the reference
    out, lse = sparse_mla_attention(q, kv, slots, SCALE)
    ref = sparse_mla_reference(q, kv, slots, SCALE)
    return pd.DataFrame({
        "valid slots": (slots >= 0).sum(1).cpu().tolist(),
        "lse head 0": lse[:, 0].cpu().tolist(),
        "reference lse head 0": ref[1][:, 0].cpu().tolist(),
        "|out| (all heads)": out.float().norm(dim=(1, 2)).cpu().tolist(),
        "max |out - ref|": (out.double() - ref[0]).abs().amax(dim=(1, 2)).cpu().tolist(),
    }, index=["-1 every other", "-1 first half", "all -1", "duplicate"])


def split_demo(device: str, T: int = 2, H: int = 8, topk: int = 256):
    """The top-k split and its log-sum-exp merge give the unsplit answer (to fp32 rounding)."""
    import pandas as pd

    q, kv, _, slots = random_problem(T, H, topk, 1024, device, seed=2)
    base, base_lse = sparse_mla_attention(q, kv, slots, SCALE, num_splits=1)
    rows = []
    for splits in (2, 4):
        for merge in ("fused", "separate"):
            out, lse = sparse_mla_attention(q, kv, slots, SCALE, num_splits=splits, merge=merge)
            rows.append({"num_splits": splits, "merge": merge,
                         "max |out - unsplit|": float((out.float() - base.float()).abs().max()),
                         "max |lse - unsplit|": float((lse - base_lse).abs().max())})
    return pd.DataFrame(rows)
