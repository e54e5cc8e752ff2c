"""Inspect a glm-dsa GGUF (one file or a shard set) without reading tensor data.

Everything comes from the headers, which gguf.GGUFReader memory-maps: a 400 GB file is inspected by
touching a few MB (tests/test_gguf_inspect.py counts the page faults). Tokenizer arrays are summarized
(count + first items), not dumped. The same tensor table can be computed for a config alone
(`tensor_table_for_config`), which is how the real GLM-5 size estimate is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import pandas as pd

from glm5lab.errors import Glm5labError
from glm5lab.gguf import names as N
from glm5lab.gguf.reader import GgufSet, numpy_shape, open_gguf

QT = gguf.GGMLQuantizationType
COMPONENTS = ["embedding", "attention", "indexer", "dense", "MoE", "MTP"]


@dataclass
class GgufReport:
    paths: list[Path]
    header: dict
    metadata: pd.DataFrame      # key, type, value (arrays summarized)
    tensors: pd.DataFrame       # name, shard, layer, component, ggml_type, shape, n_elements, bytes, offset
    hyperparams: dict           # MLA / DSA / MoE numbers from the glm-dsa.* keys
    hf_config: object           # transformers.GlmMoeDsaConfig equivalent

    @property
    def by_component(self) -> pd.DataFrame:
        return bytes_by(self.tensors, "component")

    @property
    def by_type(self) -> pd.DataFrame:
        return bytes_by(self.tensors, "ggml_type")

    @property
    def by_component_and_type(self) -> pd.DataFrame:
        return (self.tensors.pivot_table(index="component", columns="ggml_type", values="bytes",
                                         aggfunc="sum", fill_value=0)
                .reindex([c for c in COMPONENTS if c in set(self.tensors.component)]))


def bytes_by(table: pd.DataFrame, column: str) -> pd.DataFrame:
    g = table.groupby(column, sort=False).agg(tensors=("name", "size"), n_elements=("n_elements", "sum"),
                                              bytes=("bytes", "sum"))
    g["GiB"] = g["bytes"] / 2**30
    g["share"] = g["bytes"] / g["bytes"].sum()
    return g.sort_values("bytes", ascending=False)


def _summarize_field(f) -> tuple[str, object]:
    types = [t.name for t in f.types]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        n = len(f.data)
        sub = f.types[-1]
        head = []
        for idx in f.data[:3]:
            part = f.parts[idx]
            head.append(bytes(part).decode("utf-8", "replace") if sub == gguf.GGUFValueType.STRING
                        else part.tolist()[0])
        value = f"[{n} x {sub.name}] " + ", ".join(map(repr, head)) + (", ..." if n > 3 else "")
        return f"ARRAY[{sub.name}]", value
    if f.types == [gguf.GGUFValueType.STRING]:
        value = bytes(f.parts[-1]).decode("utf-8", "replace")  # shown as stored, as arrays' strings are
    else:
        value = f.contents()
    if isinstance(value, str) and len(value) > 120:
        value = value[:117] + "..."
    return types[0] if types else "?", value


def tensor_table(s: GgufSet) -> pd.DataFrame:
    n_main = int(s.arch_key("block_count", 0)) - int(s.arch_key("nextn_predict_layers", 0) or 0)
    first_dense = s.arch_key("leading_dense_block_count")
    rows = []
    for name, (shard, t) in s.tensor_index.items():
        rows.append(dict(
            name=name, shard=shard + 1, layer=N.layer_of(name),
            component=N.component_of(name, n_main, first_dense),
            ggml_type=QT(int(t.tensor_type)).name, shape=numpy_shape(t), n_elements=int(t.n_elements),
            bytes=int(t.n_bytes), offset=int(t.data_offset)))
    df = pd.DataFrame(rows, columns=["name", "shard", "layer", "component", "ggml_type", "shape", "n_elements",
                                     "bytes", "offset"])
    df["layer"] = df["layer"].astype("Int64")
    return df


def hyperparams(s: GgufSet) -> dict:
    keys = ["block_count", "leading_dense_block_count", "nextn_predict_layers", "embedding_length",
            "attention.head_count", "attention.head_count_kv", "attention.q_lora_rank",
            "attention.kv_lora_rank", "attention.key_length", "attention.value_length",
            "attention.key_length_mla", "attention.value_length_mla", "rope.dimension_count",
            "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k",
            "expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
            "expert_weights_scale", "expert_gating_func", "context_length", "vocab_size"]
    return {k: s.arch_key(k) for k in keys if s.arch_key(k) is not None}


def inspect_gguf(path_or_set) -> GgufReport:
    """Header, summarized metadata, tensor table and the equivalent HF config of a glm-dsa GGUF."""
    from glm5lab.gguf.config import hf_config_from_gguf

    s = open_gguf(path_or_set)
    first = s.first
    total_bytes = sum(p.stat().st_size for p in s.paths)
    header = dict(
        files=[str(p) for p in s.paths], shards=len(s.paths), file_bytes=total_bytes,
        gguf_version=s.meta("GGUF.version"), architecture=s.meta("general.architecture"),
        name=s.meta("general.name"),
        file_type=gguf.LlamaFileType(s.meta("general.file_type")).name if s.meta("general.file_type") is not None
        else None,
        tensors=len(s.tensor_index), metadata_keys=sum(1 for k in first.fields if not k.startswith("GGUF.")),
        alignment=first.alignment, header_bytes=sum(r.data_offset for r in s.readers),
    )
    meta_rows = []
    for key, f in first.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype, value = _summarize_field(f)
        meta_rows.append(dict(key=key, type=vtype, value=value))
    tensors = tensor_table(s)
    header["tensor_bytes"] = int(tensors["bytes"].sum())
    return GgufReport(paths=list(s.paths), header=header, metadata=pd.DataFrame(meta_rows), tensors=tensors,
                      hyperparams=hyperparams(s), hf_config=hf_config_from_gguf(s))


# ---------------------------------------------------------------- tables from a config alone

# llama-quantize's fallback when a row is not a whole number of super-blocks (k-quants need 256).
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0, QT.Q2_K: QT.IQ4_NL, QT.Q3_K: QT.IQ4_NL,
             QT.Q8_0: QT.F16}


def planned_type(gguf_name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    from glm5lab.gguf.writer import tensor_type

    t = tensor_type(gguf_name, shape, qtype)
    if t == QT.F16 and qtype != QT.F16:  # the writer's float fallback; model llama-quantize's instead
        fb = _FALLBACK.get(qtype, QT.F16)
        t = fb if shape[-1] % gguf.GGML_QUANT_SIZES[fb][0] == 0 else QT.F16
    return t


def ggml_type(qtype: str) -> QT:
    """A GGML type by name (any llama.cpp type: Q4_K, Q8_0, F16, ...), or a Glm5labError listing the names."""
    try:
        return QT[str(qtype).strip().upper()]
    except KeyError:
        raise Glm5labError(f"unknown GGML type {qtype!r}; known: {', '.join(t.name for t in QT)}") from None


def nbytes(shape: tuple[int, ...], qt: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


def tensor_table_for_config(config, qtype: str = "Q8_0", nextn_layers: int = 0) -> pd.DataFrame:
    """The tensor table a glm-dsa GGUF of `config` at `qtype` would have (no file needed)."""
    qt = ggml_type(qtype)
    geom = N.Geometry.from_hf(config, nextn_layers=nextn_layers)
    rows = []
    for name, shape in N.gguf_tensor_specs(geom):
        t = planned_type(name, shape, qt)
        n_el = 1
        for d in shape:
            n_el *= d
        rows.append(dict(name=name, layer=N.layer_of(name),
                         component=N.component_of(name, geom.num_hidden_layers, geom.first_k_dense_replace),
                         ggml_type=t.name, shape=tuple(shape), n_elements=n_el, bytes=nbytes(shape, t)))
    return pd.DataFrame(rows)


def estimate_real_glm5(qtypes=("Q4_K", "Q8_0"), nextn_layers: int = 1) -> pd.DataFrame:
    """ESTIMATE of the real GLM-5 GGUF size per component and type, from GlmMoeDsaConfig() defaults
    (78 layers, 256 experts, vocab 154880) plus `nextn_layers` MTP block(s). Uniform quantization of
    every 2-D weight (llama.cpp's F32 rules for norms/router/biases, llama-quantize's fallback types
    for rows that are not whole blocks): real "Q4_K_M"-style mixes differ by a few percent."""
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig()
    frames = []
    for q in qtypes:
        t = tensor_table_for_config(cfg, q, nextn_layers=nextn_layers)
        g = t.groupby("component").agg(tensors=("name", "size"), params=("n_elements", "sum"),
                                        bytes=("bytes", "sum"))
        g["GB"] = g["bytes"] / 1e9
        g["qtype"] = q
        frames.append(g.reset_index())
    out = pd.concat(frames, ignore_index=True)
    out["label"] = "estimate (GlmMoeDsaConfig defaults, uniform quantization)"
    return out
