"""Shared test setup. Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be
set before any kernel module is imported, so it is set here, first."""
import os
import tempfile
from pathlib import Path

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

# no example database: a property test's verdict must not depend on failures replayed from earlier local runs, so a
# developer's checkout behaves as CI's fresh clone; hypothesis's other caches go to the temp dir, not the working tree
settings.register_profile("glm5lab", database=None)
settings.load_profile("glm5lab")
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "glm5lab-hypothesis")


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


# ------------------------------------------------------------------------------------------- fresh seeds
# Kernel tests draw fresh random inputs each run (tests/seeds.py: fresh_seed). The seeds a failing test drew are
# printed with its report, and GLM5LAB_TEST_SEEDS=s1,s2,... replays them, so a failure seen once can be rerun.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    from tests.seeds import DRAWN

    DRAWN.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    from tests.seeds import DRAWN

    if report.failed and DRAWN:
        report.sections.append(("fresh seeds", "GLM5LAB_TEST_SEEDS=" + ",".join(map(str, DRAWN))))
    if report.failed and report.when == "call" and item.get_closest_marker("measured"):
        report.sections.append(("measured", MEASURED_HINT))


# Tests marked `measured` hold a rule of the code (a kernel pick, a default, the README's table) against GPU rows
# committed under results/: such a test can turn red with no code change, after a results-only commit.
MEASURED_HINT = ("this test checks a rule of the code against the GPU measurements committed under results/: if only "
                 "results changed, refit the rule (or regenerate the README table) to the new rows, or say in "
                 "results/kernels/NOTES.md why the new rows disagree")
