"""Integer helpers for the kernels' host side. triton.cdiv and triton.next_power_of_2 are Triton constexpr
functions: called from Python each goes through Triton's JIT dispatch (~3-4 us, NOTES.md v7), and a sparse-MLA call
made ten of them before its launches."""
from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


# Shared memory one block may opt into, in bytes, by NVIDIA compute capability (CUDA programming guide, "Technical
# Specifications"): what a launch needing more is refused with (Triton: OutOfResources). The ~100 KB GPUs (SM86,
# SM89, SM120, SM121: RTX 30 / 40 / 50, RTX PRO 6000 Blackwell) cannot hold tiles that Hopper's 227 KB can.
SHARED_MEMORY_PER_BLOCK = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
                           (10, 0): 232448, (10, 3): 232448, (12, 0): 101376, (12, 1): 101376}


def shared_memory_per_block(capability: tuple[int, int] | None) -> int | None:
    """Bytes of shared memory a block may use on a GPU of this compute capability; None when not known."""
    return SHARED_MEMORY_PER_BLOCK.get(tuple(capability)) if capability is not None else None


_CAPABILITY: dict = {}
_SM_COUNT: dict = {}


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once per device: a kernel call picks its tiles and paths by it
    on every launch, and torch's query is a host round trip each time."""
    idx = _cuda_index(device)
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAPABILITY[idx]


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, asked once per device (8 off CUDA: the interpreter's small grids)."""
    if device.type != "cuda":
        return 8
    idx = _cuda_index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
