"""Where the dual-consumer kernel's TMA loader lands a step's fp8_ds_mla rows, and the descriptors that land them there
(tile key "tma", NOTES.md v43).

A row's 512 e4m3 bytes are ONE TMA box [1, 4, 128] (the cache viewed as [slots, 4 chunks, 128 bytes]): four
consecutive 128-byte lines of the stage, at a 512-byte place of their own. TMA's 128-byte swizzle XORs each line's
16-byte units with the line's shared-memory address bits 7-9 -- for chunk j of a row at place p, with j + 4 (p & 1) --
so a row's place decides its swizzle: row r of a step goes to place r with bit 0 replaced by parity(r & 0b101)
(`row_place`), where the consumers' K and V^T loads pay 2-way bank conflicts instead of V^T's 4-way at place r
(`glm5lab.bench.tma_gather_probe.consumer_bank_conflicts`, NOTES.md v42). `latent_ring_layout` is that map as the
shared layout the consumers read a stage through. A row's 64 rope values are one 128-byte box into the rope tile,
whose wgmma swizzle (units XOR row % 8) TMA's is. The kernel names its boxes' destinations through unswizzled views
(Gluon 3.6 refuses a one-row box into a swizzled tile), so `swizzle_descriptors` has Triton's launcher encode both
descriptors with the 128-byte swizzle: TMA swizzles by the address it writes. Slot -1 or past the cache lies outside
a box's bounds and lands as zeros.
"""
from __future__ import annotations

from triton.experimental.gluon import language as gl

from glm5lab.errors import Glm5labError

ROW_BYTES = 656                  # an fp8_ds_mla row: 512 e4m3 bytes, 4 float32 scales, 64 bf16 rope values
ROPE_BYTE = 528
LATENT_BOX = [1, 4, 128]         # a row's latent part: four 128-byte lines
ROPE_BOX = [1, 128]              # its rope part: one line
SWIZZLE_128B = 3                 # CUtensorMapSwizzle
LINES_VIEW = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)   # the boxes' destinations
ROW_VIEW = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
PLACE_MASK = 0b101               # row r's place is odd iff parity(r & PLACE_MASK)


def row_place(r: int) -> int:
    """The 512-byte place of a step's row r: r with bit 0 replaced by parity(r & PLACE_MASK) (an involution)."""
    return r ^ (bin(r & (PLACE_MASK & ~1)).count("1") & 1)


def landing_offset(r: int, byte: int) -> int:
    """Byte offset in a stage at which TMA lands row r's latent byte `byte` (of 512): the row's four lines at its
    place, each line's 16-byte units XOR its address bits 7-9 (the stage 1024-byte aligned)."""
    p = row_place(r)
    j, unit, low = byte >> 7, (byte >> 4) & 7, byte & 15
    return (p << 9) | (j << 7) | ((unit ^ j ^ ((p & 1) << 2)) << 4) | low


def view_offset(r: int, col: int) -> int:
    """Byte offset in a stage of the consumers' column col of row r (`latent_stage_layout`): chunk j = col // 128
    at the line TMA lands it in, unit u of the view at unit u XOR 4 (place & 1) -- the line's swizzle without the
    chunk's own part (XOR j), which no column slice of a layout can carry: the view's column j * 128 + c holds the
    row's latent byte j * 128 + (c XOR 16 j) (`view_column`), and the kernel stages q's chunk j and stores O's in
    that order."""
    p = row_place(r)
    j, unit, low = col >> 7, (col >> 4) & 7, col & 15
    return (p << 9) | (j << 7) | ((unit ^ ((p & 1) << 2)) << 4) | low


def view_column(col: int) -> int:
    """The latent byte of a row that the consumers' view column col holds (`view_offset`)."""
    return col ^ ((col >> 7) << 4)


def latent_stage_layout(rows: int = 64) -> gl.SharedLinearLayout:
    """A stage's latent rows [rows, 512] in the consumers' view (`view_offset`), as a layout: chunk j's columns a
    plain slice of it (the stage's allocation 1024-byte aligned: TMA keys the swizzle by address bits 7-9)."""
    if rows < 8 or rows & (rows - 1):
        raise Glm5labError(f"a TMA ring stage takes a power of two of >= 8 rows; got {rows}")
    coords = {}
    for r in range(rows):
        for col in range(512):
            off = view_offset(r, col)
            if off & (off - 1) == 0:                 # (the offsets that are powers of two name the bases)
                coords[off] = [r, col]
    return gl.SharedLinearLayout(offset_bases=[coords[1 << i] for i in range((rows * 512).bit_length() - 1)])


def descriptors(kv, num_slots: int, kv_row_stride: int):
    """(latent, rope) TMA descriptors over an fp8_ds_mla cache (uint8, rows of 656 bytes kv_row_stride apart)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if kv.dtype.itemsize != 1 or kv.is_floating_point() or kv_row_stride % 16 or kv.data_ptr() % 16:
        raise Glm5labError(f"tma=True: the cache must be fp8_ds_mla bytes (uint8) with 16-byte aligned rows (TMA); "
                           f"got {kv.dtype}, row stride {kv_row_stride}")
    if num_slots >= 2**31:
        raise Glm5labError(f"tma=True: TMA coordinates are 32-bit; this cache has {num_slots} slots")
    return (TensorDescriptor(kv, [num_slots, 4, 128], [kv_row_stride, 128, 1], LATENT_BOX, LINES_VIEW),
            TensorDescriptor(kv, [num_slots, ROW_BYTES], [kv_row_stride, 1], ROPE_BOX, ROW_VIEW))


def swizzle_descriptors(compiled) -> None:
    """Have Triton's launcher encode the compiled kernel's two descriptors (`descriptors`) with the 128-byte
    swizzle."""
    meta = compiled.metadata.tensordesc_meta
    if not meta or [list(m["block_size"]) for m in meta] != [LATENT_BOX, ROPE_BOX]:
        raise Glm5labError(f"unexpected TMA descriptor metadata {meta!r}: Triton's launcher changed (tma=True)")
    for m in meta:
        m["swizzle"] = SWIZZLE_128B


def signatures() -> dict:
    """The descriptors' argument types for an offline build (scripts/sass_report.py)."""
    return {"LAT_DESC": f"tensordesc<u8{LATENT_BOX},{LINES_VIEW!r}>",
            "ROPE_DESC": f"tensordesc<u8{ROPE_BOX},{ROW_VIEW!r}>"}
