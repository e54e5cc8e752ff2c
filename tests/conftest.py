"""Shared test setup. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be
set before any kernel module is imported, so it is set here, first."""
import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is present (the H200 run); elsewhere they are deselected,
    not skipped-and-counted, so the CPU run reports exactly what it executed."""
    if _HAS_CUDA:
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("gpu") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def tiny_paths():
    """The tiny GLM-5 (HF checkpoint + F16/Q8_0 GGUFs), generated once into the cache and reused
    (glm5lab.model.tiny.ensure_tiny: content-hashed, written atomically)."""
    from glm5lab.model.tiny import ensure_tiny

    return ensure_tiny()
