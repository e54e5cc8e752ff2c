"""Integer helpers for the kernels' host side. triton.cdiv and triton.next_power_of_2 are Triton constexpr
functions: called from Python each goes through Triton's JIT dispatch (~3-4 us, NOTES.md v7), and a sparse-MLA call
made ten of them before its launches."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1
