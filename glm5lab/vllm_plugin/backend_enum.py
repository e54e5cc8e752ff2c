"""TRITON_MLA_SPARSE as a member of vLLM's `AttentionBackendEnum`, in whichever process asks for it.

Why this is its own module: vLLM 0.32 adds an out-of-tree backend to `AttentionBackendEnum` at run time
(`register_backend("NAME", path)`), and an enum member pickles as `AttentionBackendEnum(value)`. `vllm serve`
sends its config to the engine-core process by pickle, and a spawned process (always on CPU; on a GPU whenever
vLLM forces spawn) unpickles it before any plugin is loaded there: the member is unknown and the engine dies with
"... is not a valid AttentionBackendEnum". Ours pickles instead as a call to `member()` here, which registers it in
the new process first. This module imports only vLLM's registry, so that unpickling stays cheap.
"""
from __future__ import annotations

BACKEND_NAME = "TRITON_MLA_SPARSE"
BACKEND_PATH = "glm5lab.vllm_plugin.sparse_backend.TritonMLASparseBackend"


def member():
    """The TRITON_MLA_SPARSE member, registered with vLLM's registry first if this process has not done so yet
    (idempotent). Pickled members come back through here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    known = BACKEND_NAME in AttentionBackendEnum.__members__
    register_backend(AttentionBackendEnum[BACKEND_NAME] if known else BACKEND_NAME, BACKEND_PATH)
    ours = AttentionBackendEnum[BACKEND_NAME]
    ours.__reduce_ex__ = _reduce_by_registration  # an instance attribute: the other members pickle as before
    return ours


def _reduce_by_registration(_protocol):
    return member, ()
