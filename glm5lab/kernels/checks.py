"""Argument checks the kernels' wrappers share: one line that names the problem before a launch, and no host sync.

A kernel reads what it is given: a strided view of a small index tensor is read as its neighbours, a NaN scale
turns every output into NaN. These checks and copies keep such inputs from reaching a launch.
"""
from __future__ import annotations

import math

import torch

from glm5lab.errors import Glm5labError


def require_finite_scale(scale, name: str = "softmax_scale") -> float:
    """The scale as a float; NaN, infinities, strings and None are refused."""
    if isinstance(scale, (str, bytes)) or scale is None:
        raise Glm5labError(f"{name} must be a finite number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise Glm5labError(f"{name} must be a finite number, got {scale!r}") from None
    if not math.isfinite(value):
        raise Glm5labError(f"{name} must be a finite number, got {value}")
    return value


def index_vector(name: str, t: torch.Tensor, length: int) -> torch.Tensor:
    """A [length] int32/int64 tensor with unit stride: a column view of a wider tensor is copied, not misread."""
    if not isinstance(t, torch.Tensor) or t.shape != (length,):
        raise Glm5labError(f"{name} must be a [{length}] tensor, got {type(t).__name__} "
                           f"{tuple(getattr(t, 'shape', ()))}")
    if t.dtype not in (torch.int32, torch.int64):
        raise Glm5labError(f"{name} must be int32 or int64, got {t.dtype}")
    return t.contiguous()


def power_of_two(name: str, value, least: int = 1) -> int | None:
    """A tiling knob Triton's tl.arange needs as a power of two (None passes: the wrapper's default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise Glm5labError(f"{name} must be a power of two >= {least}, got {value!r}")
    return value


def at_least_one(**knobs) -> None:
    """Tiling counts (tiles, stages, rows a tile) a kernel takes as given: each an integer >= 1, or None (the wrapper's
    default). Named one at a time, so the message says which knob is wrong."""
    for name, value in knobs.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise Glm5labError(f"{name} must be an integer >= 1, got {value!r}")


# True while scripts/launch_build.py intercepts every launch to build it for a GPU on a CPU machine: its CPU tensors
# never reach a kernel there
LAUNCHES_INTERCEPTED = False


def require_launch_device(**tensors) -> torch.device:
    """The one device the named tensors (None skipped) share, refused in one line where a Triton kernel cannot run
    them: tensors on two devices (Triton would read a host pointer as a device one), or CPU tensors without the
    interpreter (Triton's own error there is "0 active drivers")."""
    from glm5lab.env import interpreter_mode

    named = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise Glm5labError(f"{', '.join(named)} must be on one device, got "
                           f"{', '.join(f'{name} on {t.device}' for name, t in named.items())}")
    device = next(iter(devices))
    if device.type == "cpu" and not interpreter_mode() and not LAUNCHES_INTERCEPTED:
        raise Glm5labError("CPU tensors: glm5lab's Triton kernels run on CUDA devices, or on the CPU in Triton's "
                           "interpreter (set TRITON_INTERPRET=1 before glm5lab's kernels are imported)")
    if device.type not in ("cpu", "cuda"):
        raise Glm5labError(f"tensors on {device}: glm5lab's Triton kernels run on CUDA devices (or the CPU under "
                           f"TRITON_INTERPRET=1)")
    return device
