"""Sparse top-k -> global KV slots -> virtual block table (notebook 04).

What vLLM 0.32 hands a sparse-MLA backend (`flashmla_sparse.py`, `sparse_utils.py`):
  token_indices [T, K] int32   the DSA indexer's top-k per query token, as positions *inside the token's
                               request* (0..seq_len-1), -1 = padding (anywhere in the row)
  req_id        [T]    int32   `attn_metadata.req_id_per_token`: which request (block-table row) a token is in
  block_table   [R, B] int32   physical block ids per request; token position p lives in block p // block_size
  block_size    int            the cache page size
vLLM turns that into global slots with `triton_convert_req_index_to_global_index`:
  slot = block_table[req, idx // block_size] * block_size + idx % block_size
with -1 kept as -1 and -1 also for a block index outside the table row. `req_index_to_global_slots` is
the same map in vectorized torch (CPU and GPU), tested to equal vLLM's own kernel.

The virtual block table. A paged decode kernel reads token j of row b at
  slot = block_table[b, j // page_size] * page_size + j % page_size,   j < seq_len[b].
View the physical cache [blocks, page, D] as [blocks * page, 1, D] (page_size = 1, one "page" per slot) and
give every query token its own row: block_table[t] = the token's global slots, seq_len[t] = their count.
Then slot = block_table[t, j] and the dense kernel attends exactly to the selected tokens.

Compact, not mask: a paged kernel reads entries 0..seq_len-1 of its row and has no per-entry mask, so the
valid slots must come first (in their original order) and seq_len = their count; a -1 in the middle
would either be read as a slot or cut the row short. A fused sparse kernel that loads every entry and
masks -1 needs no compaction (vLLM's `return_valid_counts=True` path compacts too, for the kernels that
read a prefix). Entries past seq_len are padded with slot 0, a valid address, so a kernel that prefetches
past the end never reads out of bounds; they are never attended.
"""
from __future__ import annotations

import dataclasses

import torch

from glm5lab.errors import Glm5labError

INT32_MAX = 2**31 - 1
_INT_DTYPES = (torch.int32, torch.int64)


def _check_int(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise Glm5labError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise Glm5labError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise Glm5labError(f"{name} must be int32 or int64, got {t.dtype}")


def req_index_to_global_slots(token_indices: torch.Tensor, req_id: torch.Tensor, block_table: torch.Tensor,
                              block_size: int, *, seq_lens: torch.Tensor | None = None,
                              query_positions: torch.Tensor | None = None,
                              block_stride_rows: int | None = None,
                              num_cache_slots: int | None = None) -> torch.Tensor:
    """Request-local top-k indices -> global physical slots, -1 in place (same layout as the input).

    Equal to vLLM's `triton_convert_req_index_to_global_index(req_id, block_table, token_indices,
    BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=block_stride_rows)` when the optional arguments are None.
    Stricter where vLLM trusts its caller:
      seq_lens [R]        indices >= the request's length become -1 (vLLM would read a stale slot of a
                          partly filled last block);
      query_positions [T] causal top-k for prefill tokens: an index after the token's own position
                          becomes -1;
      num_cache_slots     raise if the block table points outside the cache.
    A negative block id in the table (an unused entry some engines pad with) also gives -1.
    Returns int32 [T, K]; raises Glm5labError if a slot would not fit int32.
    """
    _check_int("token_indices", token_indices, 2)
    _check_int("req_id", req_id, 1)
    _check_int("block_table", block_table, 2)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise Glm5labError(f"block_size must be a positive int, got {block_size!r}")
    if block_stride_rows is not None and (isinstance(block_stride_rows, bool) or not isinstance(block_stride_rows, int)):
        raise Glm5labError(f"block_stride_rows must be an int, got {block_stride_rows!r}")
    stride = block_size if block_stride_rows is None else block_stride_rows
    if stride < block_size:
        raise Glm5labError(f"block_stride_rows {stride} is smaller than block_size {block_size}")
    num_tokens, _ = token_indices.shape
    if req_id.shape[0] != num_tokens:
        raise Glm5labError(f"req_id has {req_id.shape[0]} entries but token_indices has {num_tokens} rows")
    num_reqs, max_blocks = block_table.shape
    if seq_lens is not None:
        _check_int("seq_lens", seq_lens, 1)
        if seq_lens.shape[0] != num_reqs:
            raise Glm5labError(f"seq_lens has {seq_lens.shape[0]} entries but block_table has {num_reqs} rows")
    if query_positions is not None:
        _check_int("query_positions", query_positions, 1)
        if query_positions.shape[0] != num_tokens:
            raise Glm5labError(f"query_positions has {query_positions.shape[0]} entries, expected {num_tokens}")
    devices = {t.device for t in (token_indices, req_id, block_table, seq_lens, query_positions) if t is not None}
    if len(devices) > 1:
        raise Glm5labError(f"inputs are on different devices: {sorted(str(d) for d in devices)}")

    if num_tokens and (int(req_id.min()) < 0 or int(req_id.max()) >= num_reqs):
        raise Glm5labError(f"req_id values must be in [0, {num_reqs}), got range "
                           f"[{int(req_id.min())}, {int(req_id.max())}]")
    if block_table.numel():
        top = int(block_table.max()) * stride + block_size - 1
        if top > INT32_MAX:
            raise Glm5labError(f"block id {int(block_table.max())} x block stride {stride} gives slot {top}, "
                               f"beyond int32 ({INT32_MAX}); the cache is too large for int32 slot indices")
        if num_cache_slots is not None and top >= num_cache_slots:
            raise Glm5labError(f"block_table points at block {int(block_table.max())}, beyond the cache "
                               f"({num_cache_slots} slots)")

    idx = token_indices.long()
    req = req_id.long()[:, None]                                   # [T, 1]
    block = torch.div(idx, block_size, rounding_mode="floor")
    valid = (idx >= 0) & (block < max_blocks)
    if seq_lens is not None:
        valid &= idx < seq_lens.long()[req]
    if query_positions is not None:
        valid &= idx <= query_positions.long()[:, None]
    if max_blocks == 0:                                            # nothing to look up
        return torch.full_like(token_indices, -1, dtype=torch.int32)
    phys = block_table.long()[req, block.clamp(0, max_blocks - 1)]  # [T, K]
    valid &= phys >= 0
    slots = phys * stride + idx.remainder(block_size)
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)


def compact_valid_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's valid (>= 0) slots to the front, keeping their order; -1 after them.

    Returns (compacted int32 [T, K], counts int32 [T]). One cumsum + one scatter: no sort, no host sync.
    """
    _check_int("slots", slots, 2)
    num_tokens, topk = slots.shape
    valid = slots >= 0
    dest = torch.cumsum(valid, dim=1, dtype=torch.int64) - 1
    dest = torch.where(valid, dest, torch.full_like(dest, topk))   # invalid entries go to a spill column
    out = torch.full((num_tokens, topk + 1), -1, dtype=torch.int32, device=slots.device)
    out.scatter_(1, dest, slots.to(torch.int32))
    out[:, topk] = -1
    return out[:, :topk].contiguous(), valid.sum(dim=1, dtype=torch.int32)


@dataclasses.dataclass
class VirtualBlockTable:
    """Inputs of a page_size=1 paged kernel: row t attends cache rows block_table[t, :seq_lens[t]] of the
    cache viewed as [slots, 1, D] (`page_size_one_view`)."""

    block_table: torch.Tensor   # int32 [T, K]: valid slots first, then `pad_value`
    seq_lens: torch.Tensor      # int32 [T]: number of valid slots per row (0 for an empty row)
    page_size: int = 1


def virtual_block_table_from_slots(slots: torch.Tensor, *, pad_value: int = 0) -> VirtualBlockTable:
    """Global slots [T, K] with -1 anywhere -> virtual block table (compacted) + per-row lengths."""
    compacted, counts = compact_valid_slots(slots)
    if pad_value != -1:
        compacted = torch.where(compacted >= 0, compacted, torch.full_like(compacted, pad_value))
    return VirtualBlockTable(block_table=compacted, seq_lens=counts)


def build_virtual_block_table(token_indices: torch.Tensor, req_id: torch.Tensor, block_table: torch.Tensor,
                              block_size: int, **kwargs) -> VirtualBlockTable:
    """What vLLM hands a sparse backend -> virtual block table in one call (kwargs as in
    `req_index_to_global_slots`)."""
    return virtual_block_table_from_slots(
        req_index_to_global_slots(token_indices, req_id, block_table, block_size, **kwargs))


def page_size_one_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[blocks, page, D] or [slots, D] -> [slots, 1, D], a view when the layout allows (a copy otherwise),
    so that virtual block id == global slot == row of `flatten_kv_cache`."""
    if not isinstance(kv_cache, torch.Tensor):
        raise Glm5labError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 3:
        return kv_cache.reshape(-1, 1, kv_cache.shape[-1])
    if kv_cache.dim() == 2:
        return kv_cache.unsqueeze(1)
    raise Glm5labError(f"kv_cache must be [blocks, block_size, D] or [slots, D], got shape {tuple(kv_cache.shape)}")


def virtual_block_table_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                                  softmax_scale: float, kv_lora_rank: int = 512, *,
                                  num_splits: int | None = None, validate: bool = True
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA by the dense route: glm5lab's paged decode kernel on the virtual block table.

    Same inputs as the fused sparse kernel and `sparse_mla_reference`: q [T, H, D], kv_cache
    [blocks, page, D] or [slots, D], GLOBAL slots [T, K] with -1 = skip. Returns (out [T, H, kv_lora_rank]
    in q's dtype, lse [T, H] float32, natural log; empty rows -> 0 and -inf). `validate=False` skips the
    host-synchronizing range checks (for timing).
    """
    from glm5lab.kernels.paged_mla_decode import paged_mla_decode

    if q.dim() != 3:
        raise Glm5labError(f"q must be [tokens, heads, D], got shape {tuple(q.shape)}")
    if slots.dim() != 2 or slots.shape[0] != q.shape[0]:
        raise Glm5labError(f"slots must be [tokens={q.shape[0]}, topk], got shape {tuple(slots.shape)}")
    view = page_size_one_view(kv_cache)
    if validate and slots.numel() and int(slots.max()) >= view.shape[0]:
        raise Glm5labError(f"slot index {int(slots.max())} is beyond the cache ({view.shape[0]} slots)")
    vbt = virtual_block_table_from_slots(slots)
    return paged_mla_decode(q, view, vbt.block_table, vbt.seq_lens, softmax_scale, kv_lora_rank,
                            num_splits=num_splits, validate=validate)
