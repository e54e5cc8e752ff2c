"""A small worked example of the virtual block table, and its picture (notebook 04).

Two requests share a physical cache of 6 blocks x 4 slots; request 0 holds blocks [4, 1, 3] (10 tokens),
request 1 holds blocks [0, 5] (6 tokens). Three query tokens: the decode token of each request and one
prefill token of request 1 at position 3 (causal: it may only select positions 0..3). Top-k = 5, with -1
padding in the middle of rows and one index past request 0's length.
"""
from __future__ import annotations

from pathlib import Path

import torch

from glm5lab.files import save_figure
from glm5lab.sparse.virtual_block_table import (
    VirtualBlockTable,
    req_index_to_global_slots,
    virtual_block_table_from_slots,
)


def small_example() -> dict:
    """The example's inputs (as vLLM hands them) and every intermediate, as tensors."""
    block_size = 4
    block_table = torch.tensor([[4, 1, 3], [0, 5, -1]], dtype=torch.int32)  # -1: unused entry
    seq_lens = torch.tensor([10, 6], dtype=torch.int32)
    req_id = torch.tensor([0, 1, 1], dtype=torch.int32)
    positions = torch.tensor([9, 5, 3], dtype=torch.int32)           # decode, decode, prefill
    token_indices = torch.tensor([[9, -1, 2, 11, 5],                  # 11 is past request 0's length
                                  [0, 5, -1, -1, 3],
                                  [3, -1, 1, 4, -1]], dtype=torch.int32)  # 4 > position 3: non-causal
    slots = req_index_to_global_slots(token_indices, req_id, block_table, block_size,
                                      seq_lens=seq_lens, query_positions=positions)
    vbt = virtual_block_table_from_slots(slots)
    return {"block_size": block_size, "num_blocks": 6, "block_table": block_table, "seq_lens": seq_lens,
            "req_id": req_id, "positions": positions, "token_indices": token_indices, "slots": slots,
            "vbt": vbt}


def draw_example(ex: dict, path: str | Path, caption: str = "") -> Path:
    """Draw cache / top-k / global slots / virtual block table; write PNG atomically; return its path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    bs, nb = ex["block_size"], ex["num_blocks"]
    bt, seq_lens, req_id = ex["block_table"], ex["seq_lens"], ex["req_id"]
    ti, slots, vbt = ex["token_indices"], ex["slots"], ex["vbt"]
    req_colors = ["#8ecae6", "#ffb703", "#cdb4db"]
    tok_colors = ["#d62828", "#2a9d8f", "#6a4c93", "#e76f51"]

    owner = {}  # slot -> (request, position)
    for r in range(bt.shape[0]):
        for pos in range(int(seq_lens[r])):
            owner[int(bt[r, pos // bs]) * bs + pos % bs] = (r, pos)

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.6), gridspec_kw={"width_ratios": [1.2, 1, 1, 1]})
    ax = axes[0]
    for b in range(nb):
        for o in range(bs):
            s = b * bs + o
            r, pos = owner.get(s, (None, None))
            ax.add_patch(Rectangle((o, nb - 1 - b), 1, 1, facecolor=req_colors[r] if r is not None else "#eeeeee",
                                   edgecolor="black", lw=0.6))
            label = f"s{s}" + (f"\nr{r}:p{pos}" if r is not None else "")
            ax.text(o + 0.5, nb - 0.5 - b, label, ha="center", va="center", fontsize=7)
            for t in range(slots.shape[0]):
                if s in slots[t].tolist():
                    ax.plot(o + 0.15 + 0.17 * t, nb - 1 - b + 0.15, "o", color=tok_colors[t], ms=5)
    ax.set_xlim(0, bs)
    ax.set_ylim(0, nb)
    ax.set_yticks([nb - 0.5 - b for b in range(nb)], [f"block {b}" for b in range(nb)], fontsize=8)
    ax.set_xticks([o + 0.5 for o in range(bs)], [f"off {o}" for o in range(bs)], fontsize=8)
    tables = "; ".join(f"r{r}: {bt[r].tolist()} len {int(seq_lens[r])}" for r in range(bt.shape[0]))
    ax.set_title(f"physical cache [{nb} blocks x {bs}], block tables {tables}\n"
                 "colour = request (r:p = request:position), dot = selected by token t", fontsize=8)

    def table(ax, data, title, col_label, highlight=None, row_extra=None):
        rows, cols = data.shape
        for t in range(rows):
            for k in range(cols):
                v = int(data[t, k])
                live = highlight(t, k) if highlight else v >= 0
                ax.add_patch(Rectangle((k, rows - 1 - t), 1, 1, edgecolor="black", lw=0.6,
                                       facecolor=tok_colors[t] if live else "#eeeeee", alpha=0.35 if live else 1))
                dropped = v >= 0 and not live and highlight is not None and col_label == "k"
                ax.text(k + 0.5, rows - 0.5 - t, f"{v}\n(dropped)" if dropped else str(v), ha="center",
                        va="center", fontsize=9 if not dropped else 7, color="#b00020" if dropped else "black")
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ylabels = [f"t{t} (req {int(req_id[t])})" + (row_extra(t) if row_extra else "") for t in range(rows)]
        ax.set_yticks([rows - 0.5 - t for t in range(rows)], ylabels, fontsize=8)
        ax.set_xticks([k + 0.5 for k in range(cols)], [str(k) for k in range(cols)], fontsize=8)
        ax.set_xlabel(col_label, fontsize=8)
        ax.set_title(title, fontsize=9)

    pos = ex["positions"]
    table(axes[1], ti, "1. top-k (request-local positions)\n-1 = padding", "k",
          highlight=lambda t, k: int(slots[t, k]) >= 0, row_extra=lambda t: f" pos {int(pos[t])}")
    table(axes[2], slots, "2. global slots\nblock_table[req, i // 4] * 4 + i % 4", "k")
    seq = vbt.seq_lens
    table(axes[3], vbt.block_table, "3. virtual block table (page_size 1)\nvalid first, seq_len = count",
          "j (virtual page = slot)", highlight=lambda t, k: k < int(seq[t]),
          row_extra=lambda t: f" len {int(seq[t])}")
    if caption:
        fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, color="#444444")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return path


def example_table(ex: dict) -> "object":
    """One row per query token: its inputs and the virtual row the kernel gets (a pandas DataFrame)."""
    import pandas as pd

    vbt: VirtualBlockTable = ex["vbt"]
    rows = []
    for t in range(ex["token_indices"].shape[0]):
        n = int(vbt.seq_lens[t])
        rows.append({"token": t, "request": int(ex["req_id"][t]), "position": int(ex["positions"][t]),
                     "top-k (request-local)": ex["token_indices"][t].tolist(),
                     "global slots": ex["slots"][t].tolist(),
                     "virtual row": vbt.block_table[t, :n].tolist(), "seq_len": n})
    return pd.DataFrame(rows)


def random_sparse_batch(*, requests: int, context: int, tokens_per_request: int, topk: int, heads: int,
                        page_size: int, dtype: torch.dtype = torch.bfloat16, pad_fraction: float = 0.2,
                        seed: int = 0, device: str = "cpu") -> dict:
    """A random batch as vLLM would hand it: physical blocks shuffled over the cache, each request's last
    `tokens_per_request` positions as query tokens (causal), top-k drawn from positions <= the token's own,
    with `pad_fraction` of the entries set to -1 anywhere in the row."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-context // page_size)
    num_blocks = requests * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[: requests * max_blocks].reshape(requests, max_blocks)
    seq_lens = torch.randint(max(1, context // 2), context + 1, (requests,), generator=g)
    req_id = torch.arange(requests).repeat_interleave(tokens_per_request)
    positions = (seq_lens[req_id] - tokens_per_request + torch.arange(tokens_per_request).repeat(requests)).clamp(min=0)
    frac = torch.rand(req_id.numel(), topk, generator=g)
    token_indices = (frac * (positions[:, None] + 1)).long()               # causal: <= own position
    token_indices[torch.rand(req_id.numel(), topk, generator=g) < pad_fraction] = -1
    width = 576
    kv = torch.randn(num_blocks, page_size, width, generator=g).to(dtype)
    q = torch.randn(req_id.numel(), heads, width, generator=g).to(dtype)
    to = {"device": device}
    return {"q": q.to(**to), "kv_cache": kv.to(**to), "token_indices": token_indices.int().to(**to),
            "req_id": req_id.int().to(**to), "block_table": block_table.int().to(**to),
            "seq_lens": seq_lens.int().to(**to), "positions": positions.int().to(**to), "page_size": page_size}


def proof_table(cases: list[dict], softmax_scale: float) -> "object":
    """Virtual-block-table attention (glm5lab's paged kernel) vs the float64 sparse reference, per case."""
    import pandas as pd

    from glm5lab.sparse.reference import sparse_mla_reference
    from glm5lab.sparse.virtual_block_table import virtual_block_table_attention

    rows = []
    for case in cases:
        b = random_sparse_batch(**case)
        slots = req_index_to_global_slots(b["token_indices"], b["req_id"], b["block_table"], b["page_size"],
                                          seq_lens=b["seq_lens"], query_positions=b["positions"])
        out, lse = virtual_block_table_attention(b["q"], b["kv_cache"], slots, softmax_scale)
        ref_out, ref_lse = sparse_mla_reference(b["q"], b["kv_cache"], slots, softmax_scale)
        ok = torch.isfinite(ref_lse)
        rows.append({**{k: (str(v).replace("torch.", "") if k == "dtype" else v) for k, v in case.items()
                        if k != "device"},
                     "tokens": int(slots.shape[0]), "valid slots": int((slots >= 0).sum()),
                     "max |out - ref|": float((out.double() - ref_out).abs().max()),
                     "max |lse - ref|": float((lse.double() - ref_lse)[ok].abs().max()) if ok.any() else 0.0,
                     "NaN in out": bool(torch.isnan(out).any())})
    return pd.DataFrame(rows)


def dense_equivalence_check(*, context: int, topk: int, page_size: int, heads: int, softmax_scale: float,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu") -> dict:
    """Top-k >= context: every position is selected (shuffled, -1 padded), so the virtual-block-table
    path must equal dense attention over the request's whole context (float64 `dense_mla_reference`)."""
    from glm5lab.sparse.reference import dense_mla_reference
    from glm5lab.sparse.virtual_block_table import virtual_block_table_attention

    if topk < context:
        return {"status": "not applicable", "reason": f"top-k {topk} < context {context}"}
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-context // page_size)
    block_table = torch.randperm(max_blocks + 3, generator=g)[:max_blocks].reshape(1, max_blocks).int()
    kv = torch.randn(max_blocks + 3, page_size, 576, generator=g).to(dtype)
    q = torch.randn(1, heads, 576, generator=g).to(dtype)
    token_indices = torch.full((1, topk), -1, dtype=torch.int32)
    token_indices[0, torch.randperm(topk, generator=g)[:context]] = torch.randperm(context, generator=g).int()
    seq_lens = torch.tensor([context], dtype=torch.int32)
    q, kv, token_indices, block_table, seq_lens = (t.to(device) for t in (q, kv, token_indices, block_table,
                                                                          seq_lens))
    slots = req_index_to_global_slots(token_indices, torch.zeros(1, dtype=torch.int32, device=device),
                                      block_table, page_size, seq_lens=seq_lens)
    out, lse = virtual_block_table_attention(q, kv, slots, softmax_scale)
    d_out, d_lse = dense_mla_reference(q, kv, block_table, seq_lens, softmax_scale)
    return {"status": "ran", "context": context, "topk": topk, "page_size": page_size,
            "dtype": str(dtype).replace("torch.", ""),
            "max |out - dense|": float((out.double() - d_out).abs().max()),
            "max |lse - dense|": float((lse.double() - d_lse).abs().max())}
