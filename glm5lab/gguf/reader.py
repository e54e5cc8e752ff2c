"""Open a glm-dsa GGUF file or split-shard set safely, and read its tensors back by HF name.

Opening only parses headers (gguf.GGUFReader memory-maps the file; tensor data is not touched), and turns
every malformed input into a one-line Glm5labError naming the file: wrong magic, truncated header,
truncated tensor data, another architecture, and, for shard sets, missing/duplicate/foreign shards.
"""
from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from glm5lab.errors import Glm5labError
from glm5lab.gguf import names as N

SPLIT_NO = gguf.Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS = gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)
SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _TruncatedData(Exception):
    pass


class _BadTensorTable(Exception):
    """A tensor table that parsed but names something impossible: the message is the user's."""


class _Reader(gguf.GGUFReader):
    """GGUFReader that tells a cut-off data section (tensor views cannot be built) from a bad header, and a duplicate
    name or an unknown type id in the tensor table from both."""

    def _build_tensors(self, start_offs, fields):
        try:
            super()._build_tensors(start_offs, fields)
        except ValueError as exc:
            text = str(exc)
            dup = re.match(r"Found duplicated tensor with name (.+)", text)
            if dup:
                raise _BadTensorTable(f"tensor name {dup.group(1)} appears twice in the tensor table") from None
            unknown = re.match(r"(?:np\.\w+\()?(-?\d+)\)? is not a valid GGMLQuantizationType", text)
            if unknown:
                raise _BadTensorTable(f"a tensor has type id {unknown.group(1)}, which is no GGML type known to "
                                      f"gguf {_gguf_version()}") from None
            raise _TruncatedData(text) from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _preamble(path: Path, size: int) -> str:
    """What the file's fixed 24-byte preamble declares, for a header that did not parse: the reader's own error is
    numpy's, about array sizes, where a user needs to know how much the header claims and how much file there is."""
    if size < 24:
        return f"the file has {size} bytes, a GGUF preamble alone needs 24"
    with open(path, "rb") as f:
        version, tensors, keys = struct.unpack("<IQQ", f.read(24)[4:])
    if version not in (1, 2, 3):
        return f"unknown GGUF version {version} in a {size}-byte file"
    return f"version {version} declares {keys} metadata keys and {tensors} tensors, which do not parse within the " \
           f"file's {size} bytes"


def open_reader(path: Path | str) -> gguf.GGUFReader:
    """GGUFReader for one file, with bad input reported as Glm5labError (never a deep traceback)."""
    path = Path(path)
    if path.is_dir():
        raise Glm5labError(f"{path}: is a folder, not a GGUF file")
    if not path.is_file():
        raise Glm5labError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise Glm5labError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = _Reader(path, "r")
    except _BadTensorTable as exc:
        raise Glm5labError(f"{path}: {exc}") from None
    except _TruncatedData:
        raise Glm5labError(f"{path}: truncated tensor data (file has {size} bytes)") from None
    except Exception:  # numpy/struct errors from a header cut short or garbled: their text names no GGUF field
        raise Glm5labError(f"{path}: truncated or corrupt GGUF header ({_preamble(path, size)})") from None
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=reader.data_offset)
    if end > size:
        raise Glm5labError(f"{path}: truncated tensor data (file has {size} bytes, tensors need {end})")
    for t in reader.tensors:
        if t.data.nbytes != int(t.n_bytes):
            raise Glm5labError(f"{path}: truncated tensor data at {t.name}")
    reader.source_path = path
    return reader


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError as exc:  # GGUF strings are UTF-8; a corrupt byte would surface from deep in gguf
        where = getattr(reader, "source_path", "GGUF")
        raise Glm5labError(f"{where}: metadata {key} is not valid UTF-8 (byte {exc.start} of the value): "
                           f"a corrupt file") from None


def architecture(reader: gguf.GGUFReader) -> str | None:
    return field_value(reader, gguf.Keys.General.ARCHITECTURE)


def require_glm_dsa(path: Path, reader: gguf.GGUFReader) -> None:
    arch = architecture(reader)
    if arch != N.ARCH_NAME:
        raise Glm5labError(f"{path}: architecture {arch!r} is not {N.ARCH_NAME!r} (GLM-5)")


@dataclass
class GgufSet:
    """One GGUF model: a single file, or the shards of a split set in order."""

    paths: list[Path]
    readers: list[gguf.GGUFReader]
    is_split: bool = False
    tensor_index: dict = field(default_factory=dict)  # name -> (shard index, ReaderTensor)

    @property
    def first(self) -> gguf.GGUFReader:
        return self.readers[0]

    def meta(self, key: str, default=None):
        return field_value(self.first, key, default)

    def arch_key(self, suffix: str, default=None):
        return self.meta(f"{N.ARCH_NAME}.{suffix}", default)

    def tensor(self, name: str):
        return self.tensor_index[name][1]


def shard_siblings(path: Path) -> list[Path] | None:
    """For `<stem>-0000k-of-0000N.gguf`, the N expected shard paths (present or not); else None."""
    m = SHARD_RE.match(path.name)
    if not m:
        return None
    count = int(m.group("count"))
    return [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def open_gguf(path_or_paths, arch_check: bool = True) -> GgufSet:
    """Open a single GGUF, a shard set (pass any one shard, or the list), validating the whole set."""
    if isinstance(path_or_paths, GgufSet):
        return path_or_paths
    if isinstance(path_or_paths, (list, tuple)):
        paths = [Path(p) for p in path_or_paths]
    else:
        p = Path(path_or_paths)
        siblings = shard_siblings(p)
        paths = siblings if siblings else [p]
    from glm5lab.gguf.shards import validate_shard_set

    if len(paths) == 1 and not shard_siblings(paths[0]):
        reader = open_reader(paths[0])
        if field_value(reader, SPLIT_COUNT, 1) not in (None, 1):   # before the architecture: later shards have none
            raise Glm5labError(f"{paths[0]}: is shard {int(field_value(reader, SPLIT_NO)) + 1} of a "
                               f"{field_value(reader, SPLIT_COUNT)}-file split set; open the whole set")
        if arch_check:
            require_glm_dsa(paths[0], reader)
        s = GgufSet(paths=paths, readers=[reader])
    else:
        s = validate_shard_set(paths, arch_check=arch_check)
    s.tensor_index = {t.name: (i, t) for i, r in enumerate(s.readers) for t in r.tensors}
    return s


# ---------------------------------------------------------------- tensors back

def numpy_shape(t) -> tuple[int, ...]:
    """GGUF stores ggml `ne` (fastest first); numpy/torch order is the reverse."""
    return tuple(int(x) for x in reversed(list(t.shape)))


def dequantize(t) -> np.ndarray:
    """float32 array of one ReaderTensor in numpy shape (F32/F16/BF16 exact, quantized via gguf.quants)."""
    qt = gguf.GGMLQuantizationType(int(t.tensor_type))
    if qt == gguf.GGMLQuantizationType.F32:
        arr = np.asarray(t.data, dtype=np.float32)
    elif qt == gguf.GGMLQuantizationType.F16:
        arr = np.asarray(t.data).astype(np.float32)
    else:
        try:
            arr = gguf.quants.dequantize(np.asarray(t.data), qt)
        except NotImplementedError:
            raise Glm5labError(f"tensor {t.name} is {qt.name}, a type gguf {_gguf_version()} cannot dequantize "
                               f"(supported: {', '.join(supported_type_names())})") from None
    return arr.reshape(numpy_shape(t))


@functools.lru_cache(maxsize=1)
def supported_type_names() -> tuple[str, ...]:
    """GGML types whose tensors glm5lab reads back: F32, F16 and whatever the installed gguf.quants dequantizes
    (asked of gguf itself, one zero block a type, so a newer gguf's types count without a change here)."""
    names = ["F32", "F16"]
    for qt in gguf.GGMLQuantizationType:
        if qt.name in names or qt not in gguf.GGML_QUANT_SIZES:
            continue
        try:
            gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qt][1], np.uint8), qt)
        except NotImplementedError:
            continue
        except Exception:  # noqa: BLE001 -- a type gguf implements but a zero block upsets is still supported
            pass
        names.append(qt.name)
    return tuple(names)


def require_readable_types(s: "GgufSet") -> None:
    """Refuse a file set holding a tensor type glm5lab cannot read back, naming one such tensor and its type
    (gguf's own NotImplementedError names neither, and vLLM's names a fused layer)."""
    odd = unsupported_tensors(s)
    if odd:
        name, qt = next(iter(odd.items()))
        raise Glm5labError(f"{s.paths[0]}: {len(odd)} tensor(s) of a type glm5lab cannot read, e.g. {name} ({qt}); "
                           f"it reads {', '.join(supported_type_names())}")


def unsupported_tensors(s: "GgufSet") -> dict[str, str]:
    """{tensor name: type name} of the tensors glm5lab cannot read back (checked before a load starts)."""
    ok = set(supported_type_names())
    out = {}
    for name, (_, t) in s.tensor_index.items():
        qt = gguf.GGMLQuantizationType(int(t.tensor_type))
        if qt.name not in ok:
            out[name] = qt.name
    return out


def read_gguf_tensors(path_or_set, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors by GGUF name (float32, numpy shape); `names` limits which are read."""
    s = open_gguf(path_or_set)
    wanted = names if names is not None else list(s.tensor_index)
    out = {}
    for n in wanted:
        if n not in s.tensor_index:
            raise Glm5labError(f"{s.paths[0]}: no tensor {n!r}")
        out[n] = dequantize(s.tensor(n))
    return out


def read_hf_tensors(path_or_set, names: list[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors by HF checkpoint name (the per-expert on-disk layout of the real GLM-5 checkpoint):
    attn_k_b/attn_v_b are joined back into kv_b_proj, ffn_*_exps unstacked into
    mlp.experts.{e}.{gate,up,down}_proj.weight. float32, dequantized. `names` (HF names) limits the work."""
    s = open_gguf(path_or_set)
    n_blocks = int(s.arch_key("block_count"))
    inverse = N._inverse_map(n_blocks)
    out: dict[str, np.ndarray] = {}
    want = set(names) if names is not None else None

    def wants(hf_name: str) -> bool:
        return want is None or hf_name in want

    for gname in s.tensor_index:
        bid = N.layer_of(gname)
        if bid is not None and gname == N.tname(N.T.ATTN_K_B, bid):
            hf_name = f"model.layers.{bid}.self_attn.kv_b_proj.weight"
            if wants(hf_name):
                out[hf_name] = N.join_kv_b(dequantize(s.tensor(gname)),
                                           dequantize(s.tensor(N.tname(N.T.ATTN_V_B, bid))))
        elif bid is not None and gname == N.tname(N.T.ATTN_V_B, bid):
            continue
        elif bid is not None and any(gname == N.tname(k, bid) for k in N.EXPERT_PROJ.values()):
            proj = next(p for p, k in N.EXPERT_PROJ.items() if gname == N.tname(k, bid))
            expert_names = [f"model.layers.{bid}.mlp.experts.{e}.{proj}.weight"
                            for e in range(numpy_shape(s.tensor(gname))[0])]
            if any(wants(n) for n in expert_names):
                stacked = dequantize(s.tensor(gname))
                for e, n in enumerate(expert_names):
                    if wants(n):
                        out[n] = stacked[e]
        else:
            hf_name = inverse.get(gname)
            if hf_name is None:
                continue  # e.g. MTP/NextN tensors: not part of the HF trunk
            if wants(hf_name):
                out[hf_name] = dequantize(s.tensor(gname))
    if want is not None and want - set(out):
        raise Glm5labError(f"{s.paths[0]}: no tensor for HF name(s) {sorted(want - set(out))[:3]}")
    return out


def file_size(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def hf_model_from_gguf(path_or_set, dtype=None):
    """transformers GlmMoeDsaForCausalLM built from a GGUF alone: config from the metadata, weights
    dequantized (float32 unless `dtype`). The right reference for comparing an engine that serves the
    GGUF: same (quantized) weights, so differences are the engine's, not the quantization's."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    from glm5lab.gguf.config import hf_config_from_gguf

    s = open_gguf(path_or_set)
    cfg = hf_config_from_gguf(s)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg)
    tensors = read_hf_tensors(s)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            state[name] = torch.stack([torch.from_numpy(np.concatenate(
                [tensors[f"{pre}{e}.gate_proj.weight"], tensors[f"{pre}{e}.up_proj.weight"]]))
                for e in range(p.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            state[name] = torch.stack([torch.from_numpy(np.array(tensors[f"{pre}{e}.down_proj.weight"]))
                                       for e in range(p.shape[0])])
        elif name in tensors:
            state[name] = torch.from_numpy(np.array(tensors[name]))
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            state[name] = torch.from_numpy(np.array(tensors["model.embed_tokens.weight"]))
        else:
            raise Glm5labError(f"{s.paths[0]}: no tensor for {name}")
    model.load_state_dict(state, assign=True)
    model = model.to(dtype or torch.float32)
    # buffers created on the meta device (rotary inv_freq) must be rebuilt for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model.eval()
