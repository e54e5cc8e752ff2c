"""Fresh seeds for the kernel tests' random inputs: a new seed each run (never one fixed input), reported when a
test fails and replayable (conftest.py)."""
import os
import random

DRAWN: list[int] = []
_REPLAY = [int(s) for s in os.environ.get("GLM5LAB_TEST_SEEDS", "").split(",") if s.strip()]


def fresh_seed() -> int:
    """A new random seed each call (or the next one of GLM5LAB_TEST_SEEDS), recorded for the failure report.
    It does not touch torch's global generator, unlike torch.seed()."""
    seed = _REPLAY[len(DRAWN) % len(_REPLAY)] if _REPLAY else random.SystemRandom().randrange(2**31)
    DRAWN.append(seed)
    return seed
