"""An HF checkpoint folder read with errors that name the file: the GGUF writer, the doctor, the loader check and
`generate` all take one, and transformers' or safetensors' own errors (an OSError about a JSON decode, "incomplete
metadata") do not say which file is broken or what to do about it."""
from __future__ import annotations

from pathlib import Path

from glm5lab.errors import Glm5labError, first_line


def read_hf_config(path: Path | str):
    """The transformers config of an HF checkpoint folder (or of its config.json)."""
    path = Path(path).expanduser()
    folder = path.parent if path.name == "config.json" else path
    config_json = folder / "config.json"
    if not config_json.is_file():
        raise Glm5labError(f"{folder}: not an HF checkpoint (no config.json)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as exc:  # JSON errors, unknown model types: transformers wraps them in OSError / ValueError
        raise Glm5labError(f"{config_json}: transformers cannot read it ({first_line(exc)})") from None


def safetensors_files(folder: Path | str) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise Glm5labError(f"{folder}: no *.safetensors files")
    return files


def safetensors_keys(file: Path) -> list[str]:
    """The tensor names of one safetensors file; a truncated or corrupt file is named."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:
        raise Glm5labError(f"{file}: not a readable safetensors file ({first_line(exc)})") from None


def load_safetensors(file: Path) -> dict:
    """Every tensor of one safetensors file as numpy arrays; a truncated or corrupt file is named."""
    from safetensors.numpy import load_file

    try:
        return load_file(str(file))
    except Exception as exc:
        raise Glm5labError(f"{file}: not a readable safetensors file ({first_line(exc)})") from None
