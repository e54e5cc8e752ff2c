"""Split-shard sets (llama.cpp `gguf-split` layout): validate, merge into one file, split one file.

The published GLM-5 GGUF came as ten `-0000k-of-00010.gguf` shards; vLLM reads one file. Layout, as
llama.cpp writes it: shard 1 carries all metadata plus `split.no`, `split.count`,
`split.tensors.count`; later shards carry only the three split keys; tensors are spread in file order.

Merge and split stream tensor bytes from the memory-mapped inputs in chunks (never a whole tensor set in
memory), show tqdm progress, and write to a temporary file renamed only on success. Metadata key/value
records are copied byte-for-byte, so merge(split(f)) == f exactly.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple

import gguf

from glm5lab.errors import Glm5labError
from glm5lab.files import require_file_target, temp_beside
from glm5lab.gguf import names as N
from glm5lab.gguf.reader import (SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS, GgufSet, field_value,
                                 numpy_shape, open_reader, require_glm_dsa)

CHUNK = 64 << 20


def validate_shard_set(paths: list[Path], arch_check: bool = True) -> GgufSet:
    """Check a shard set is complete, unique, in order and from one model; return it opened.

    Not caught: a shard from another quantization of the same model split the same way. Later shards carry no
    metadata but the split keys, and a quantization mixes tensor types by design, so the types prove nothing;
    the merged file would hold both types, under shard 1's `file_type`."""
    paths = [Path(p) for p in paths]
    seen: dict[str, Path] = {}
    for p in paths:
        key = os.path.realpath(p)
        if key in seen:
            raise Glm5labError(f"{p}: duplicate shard (listed twice)")
        seen[key] = p
    # the files given (open_gguf passes one shard's siblings by name); a list given whole is checked by each file's
    # split.no below, not by its neighbours' names, so a renamed shard in it is no "missing" one
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise Glm5labError(f"{missing[0]}: missing shard ({len(missing)} of {len(paths)} absent)")
    readers = [open_reader(p) for p in paths]
    count = field_value(readers[0], SPLIT_COUNT)
    if count is None:
        raise Glm5labError(f"{paths[0]}: not a split shard (no {SPLIT_COUNT} key)")
    total = field_value(readers[0], SPLIT_TENSORS)
    by_no: dict[int, Path] = {}
    for p, r in zip(paths, readers):
        no, cnt, tot = field_value(r, SPLIT_NO), field_value(r, SPLIT_COUNT), field_value(r, SPLIT_TENSORS)
        if no is None or cnt is None:
            raise Glm5labError(f"{p}: not a split shard (no split.* keys)")
        if cnt != count or tot != total:
            raise Glm5labError(f"{p}: shard from another model or split (split.count {cnt}, "
                               f"split.tensors.count {tot}; first shard says {count}, {total})")
        if no in by_no:
            raise Glm5labError(f"{p}: duplicate shard (split.no {no} already in {by_no[no].name})")
        by_no[no] = p
    if len(paths) != count:
        absent = sorted(set(range(count)) - set(by_no))
        raise Glm5labError(f"{paths[0]}: shard set incomplete: {len(paths)} of {count} shards given, "
                           f"split.no {absent[:5]} missing")
    if set(by_no) != set(range(count)):
        odd = min(set(by_no) - set(range(count)))
        raise Glm5labError(f"{by_no[odd]}: split.no {odd} is outside 0-{count - 1} (split.count {count})")
    order = sorted(range(len(paths)), key=lambda i: field_value(readers[i], SPLIT_NO))
    paths = [paths[i] for i in order]  # any order given; shard 1 (split.no 0) holds the metadata
    readers = [readers[i] for i in order]
    if arch_check:
        require_glm_dsa(paths[0], readers[0])
    n_tensors = sum(len(r.tensors) for r in readers)
    if n_tensors != total:
        raise Glm5labError(f"{paths[-1]}: shard set holds {n_tensors} tensors but split.tensors.count is {total}")
    names: dict[str, Path] = {}
    for p, r in zip(paths, readers):
        for t in r.tensors:
            if t.name in names:
                raise Glm5labError(f"{p}: tensor {t.name} also in {names[t.name].name} (shard from another set?)")
            names[t.name] = p
    s = GgufSet(paths=paths, readers=readers, is_split=True)
    s.tensor_index = {t.name: (i, t) for i, r in enumerate(readers) for t in r.tensors}
    if arch_check:
        _check_geometry(s)
    return s


class TensorMismatches(NamedTuple):
    """A file set's tensors against what its own metadata implies (glm5lab.gguf.shards.geometry_mismatches)."""

    missing: list[str]                            # implied, absent
    wrong: dict[str, tuple[tuple, tuple]]         # name -> (shape found, shape implied)
    beyond_blocks: list[str]                      # blk.N tensors with N past the metadata's block_count


def geometry_mismatches(s: GgufSet, cfg=None) -> TensorMismatches:
    """The set's tensors against the GLM-5 geometry of its own metadata (`cfg`: its config, when the caller has it
    already). Reads no tensor data."""
    from glm5lab.gguf.config import hf_config_from_gguf

    cfg = cfg if cfg is not None else hf_config_from_gguf(s)
    nextn = int(s.arch_key("nextn_predict_layers", 0) or 0)
    expected = {name: tuple(shape) for name, shape in N.gguf_tensor_specs(N.Geometry.from_hf(cfg, nextn_layers=nextn))}
    missing = [name for name in expected if name not in s.tensor_index]
    wrong = {name: (numpy_shape(t), expected[name]) for name, (_, t) in s.tensor_index.items()
             if name in expected and expected[name] != numpy_shape(t)}
    blocks = cfg.num_hidden_layers + nextn
    beyond = [name for name in s.tensor_index if (N.layer_of(name) or 0) >= blocks]
    return TensorMismatches(missing, wrong, beyond)


def require_loadable_tensors(s: GgufSet, cfg=None) -> None:
    """Refuse, before an engine starts, a file set whose main-model tensors its metadata contradicts (missing, of
    another shape, blocks past block_count) or that holds a tensor type glm5lab cannot read back. The NextN block
    is left to the loader, which skips it. `cfg`: the set's config from its metadata, when the caller has it. Reads
    no tensor data."""
    from glm5lab.gguf.config import hf_config_from_gguf
    from glm5lab.gguf.reader import require_readable_types

    require_readable_types(s)
    cfg = cfg if cfg is not None else hf_config_from_gguf(s)
    n_main = cfg.num_hidden_layers        # block_count less the NextN layers

    def main(name: str) -> bool:   # a tensor of the main model (not of the NextN block the loader skips)
        return (N.layer_of(name) or 0) < n_main

    m = geometry_mismatches(s, cfg)
    missing = [name for name in m.missing if main(name)]
    if missing:
        raise Glm5labError(f"{s.paths[0]}: {len(missing)} tensor(s) its metadata implies are absent, e.g. "
                           f"{missing[0]} (a file of another geometry, or an incomplete one)")
    wrong = {name: shapes for name, shapes in m.wrong.items() if main(name)}
    if wrong:
        name, (found, implied) = next(iter(wrong.items()))
        raise Glm5labError(f"{s.paths[0]}: tensor {name} has shape {found}, its metadata implies {implied} "
                           f"({len(wrong)} such)")
    if m.beyond_blocks:
        raise Glm5labError(f"{s.paths[0]}: tensor {m.beyond_blocks[0]} lies past the metadata's "
                           f"{N.ARCH_NAME}.block_count {int(s.arch_key('block_count'))}")
    float_types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    for bid in range(n_main):   # vLLM fuses these two into one layer, which must be all quantized or all float
        pair = [N.tname(N.T.ATTN_Q_A, bid), N.tname(N.T.ATTN_KV_A_MQA, bid)]
        kinds = [gguf.GGMLQuantizationType(int(s.tensor(name).tensor_type)) for name in pair]
        if (kinds[0] in float_types) != (kinds[1] in float_types):
            raise Glm5labError(f"{s.paths[0]}: {pair[0]} is {kinds[0].name} and {pair[1]} is {kinds[1].name}; vLLM "
                               f"fuses them into one layer (fused_qkv_a_proj), so both must be quantized or both float")


def _check_geometry(s: GgufSet) -> None:
    """Every tensor's shape must be what shard 1's metadata implies: catches a shard of another model
    that happens to have the same shard and tensor counts."""
    wrong = geometry_mismatches(s).wrong
    if wrong:
        name, (found, implied) = next(iter(wrong.items()))
        raise Glm5labError(f"{s.paths[s.tensor_index[name][0]]}: tensor {name} has shape {found}, the set's "
                           f"metadata implies {implied} (shard from another model)")


# ---------------------------------------------------------------- low-level GGUF assembly

def _raw_kv_records(reader: gguf.GGUFReader, skip=SPLIT_KEYS) -> list[bytes]:
    """Each metadata record's exact bytes (key + type + value), in file order, less `skip` keys."""
    out = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        size = sum(int(p.nbytes) for p in f.parts)
        out.append(bytes(reader.data[f.offset:f.offset + size]))
    return out


def _pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _split_kv(no: int, count: int, total: int) -> list[bytes]:
    V = gguf.GGUFValueType
    return [
        _pack_str(SPLIT_NO) + struct.pack("<IH", V.UINT16, no),
        _pack_str(SPLIT_COUNT) + struct.pack("<IH", V.UINT16, count),
        _pack_str(SPLIT_TENSORS) + struct.pack("<Ii", V.INT32, total),
    ]


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _write_gguf_stream(fout, version: int, kv: list[bytes], tensors: list, readers_data, align: int, bar) -> None:
    """Header, metadata, tensor infos, then each tensor's bytes copied from its memory-mapped source."""
    fout.write(struct.pack("<IIQQ", gguf.GGUF_MAGIC, version, len(tensors), len(kv)))
    for rec in kv:
        fout.write(rec)
    offset = 0
    for t in tensors:
        dims = [int(d) for d in t.shape]
        fout.write(_pack_str(t.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                   + struct.pack("<IQ", int(t.tensor_type), offset))
        offset += _pad(int(t.n_bytes), align)
    fout.write(b"\0" * (_pad(fout.tell(), align) - fout.tell()))
    for t, src in zip(tensors, readers_data):
        n = int(t.n_bytes)
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            fout.write(src[t.data_offset + start:t.data_offset + end].tobytes())
            if bar is not None:
                bar.update(end - start)
        fout.write(b"\0" * (_pad(n, align) - n))


def _alignment(reader) -> int:
    return int(field_value(reader, gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT))


def _version(reader) -> int:
    return int(field_value(reader, "GGUF.version", 3))


def merge_shards(shards, out_path: Path | str, progress: bool = True) -> Path:
    """Merge a validated shard set (any shard path, or the list) into one GGUF at out_path."""
    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(shards)
    if not s.is_split:
        raise Glm5labError(f"{s.paths[0]}: not a split shard set")
    out_path = Path(out_path)
    if out_path.exists():
        for i, p in enumerate(s.paths, 1):
            if os.path.samefile(out_path, p):
                raise Glm5labError(f"{out_path}: is shard {i} of the set being merged; give another output name")
    require_file_target(out_path)
    first = s.readers[0]
    kv = _raw_kv_records(first)
    tensors = [t for r in s.readers for t in r.tensors]
    srcs = [r.data for r in s.readers for _ in r.tensors]
    return _atomic_write(out_path, lambda f, bar: _write_gguf_stream(
        f, _version(first), kv, tensors, srcs, _alignment(first), bar),
        total=sum(int(t.n_bytes) for t in tensors), progress=progress, desc="merge")


def split_gguf(path: Path | str, n_shards: int, out_path: Path | str | None = None,
               progress: bool = True) -> list[Path]:
    """Split one GGUF into n_shards llama.cpp-style shards (<stem>-0000k-of-0000N.gguf)."""
    from glm5lab.gguf.reader import open_gguf
    from glm5lab.gguf.writer import shard_paths

    s = open_gguf(path)
    if s.is_split:
        raise Glm5labError(f"{s.paths[0]}: already a split shard set")
    reader = s.readers[0]
    tensors = list(reader.tensors)
    if len(tensors) < 2:
        raise Glm5labError(f"{s.paths[0]}: holds {len(tensors)} tensor(s); a split needs at least 2")
    if not 2 <= n_shards <= len(tensors):
        raise Glm5labError(f"n_shards must be between 2 and {len(tensors)} (the tensor count), got {n_shards}")
    base = Path(out_path) if out_path else s.paths[0]
    if base.is_dir() or str(out_path or "").endswith(("/", os.sep)):   # --out FOLDER[/]: in it, named after the input
        base = base / s.paths[0].name
    targets = shard_paths(base, n_shards)
    for target in targets:
        require_file_target(target)
        if target.exists() and os.path.samefile(target, s.paths[0]):
            raise Glm5labError(f"{target}: would overwrite the file being split")
    bounds = [round(i * len(tensors) / n_shards) for i in range(n_shards + 1)]
    kv_all = _raw_kv_records(reader)
    tmp_files: list[Path] = []
    try:
        for i, target in enumerate(targets):
            part = tensors[bounds[i]:bounds[i + 1]]
            kv = (kv_all if i == 0 else []) + _split_kv(i, n_shards, len(tensors))
            tmp = _atomic_write(target, lambda f, bar, part=part, kv=kv: _write_gguf_stream(
                f, _version(reader), kv, part, [reader.data] * len(part), _alignment(reader), bar),
                total=sum(int(t.n_bytes) for t in part), progress=progress,
                desc=f"split {i + 1}/{n_shards}", rename=False)
            tmp_files.append(tmp)
        for tmp, target in zip(tmp_files, targets):
            os.replace(tmp, target)
        tmp_files = []
        return targets
    finally:
        for tmp in tmp_files:
            tmp.unlink(missing_ok=True)


def _atomic_write(out_path: Path, write, total: int, progress: bool, desc: str, rename: bool = True) -> Path:
    fd, tmp = temp_beside(out_path)
    bar = None
    try:
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)
        with os.fdopen(fd, "wb") as f:
            write(f, bar)
        if rename:
            os.replace(tmp, out_path)
            return out_path
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
