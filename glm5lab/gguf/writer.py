"""HF GLM-5 checkpoint -> GGUF in llama.cpp's `glm-dsa` layout (single file or N split shards).

Follows llama.cpp's converter (convert_hf_to_gguf.py: `GlmMoeDsaModel(DeepseekV2Model)` and
`ModelBase.prepare_tensors`): kv_b split into attn_k_b/attn_v_b, experts stacked into ffn_*_exps,
e_score_correction_bias -> exp_probs_b.bias, DSA indexer tensors, the MLA key/value lengths written the
way llama.cpp's MQA-absorbed kernels read them (key_length = kv_lora+rope, value_length = kv_lora,
head_count_kv = 1, key/value_length_mla = the per-head sizes). Type rules are llama.cpp's too: 1-D
tensors, `*_norm.weight`, `ffn_gate_inp`, `indexer.proj` and non-`.weight` tensors stay F32; a tensor
whose rows do not fill whole quant blocks falls back to F16.

Everything is written to a temporary name in the target directory and renamed only on success.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

import gguf
import numpy as np

from glm5lab.errors import Glm5labError
from glm5lab.files import cannot_write_there, make_folder, require_file_target, require_not_an_input, temp_beside
from glm5lab.gguf import names as N

WRITER_VERSION = 2  # bump when the bytes the writer produces change (ensure_tiny re-generates then)

QT = gguf.GGMLQuantizationType
SUPPORTED_QTYPES = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0}
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
# llama.cpp's prepare_tensors keeps these F32 whatever the file type ("DSA indexer weights should be F32")
_ALWAYS_F32_KINDS = (N.T.FFN_GATE_INP, N.T.INDEXER_PROJ)


def parse_qtype(qtype: str) -> QT:
    try:
        return SUPPORTED_QTYPES[qtype.upper()]
    except KeyError:
        raise Glm5labError(f"unsupported GGUF type {qtype!r}; choose one of {', '.join(SUPPORTED_QTYPES)}") from None


def tensor_type(gguf_name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    """The GGML type llama.cpp's converter gives this tensor when the file type is `qtype`."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return QT.F32
    bid = N.layer_of(gguf_name)
    if any(gguf_name == N.tname(k, bid) for k in _ALWAYS_F32_KINDS if bid is not None):
        return QT.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block != 0:
        return QT.F16  # llama.cpp: "cannot quantize ... falling back to F16"
    return qtype


def encode(array: np.ndarray, ttype: QT) -> np.ndarray:
    """float32 array -> the bytes (or float array) GGUFWriter stores for that type."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if ttype == QT.F32:
        return array
    return gguf.quants.quantize(array, ttype)


# ---------------------------------------------------------------- HF side

def _per_expert(hf: Mapping[str, Callable[[], np.ndarray]]) -> dict:
    """Accept transformers' fused in-memory expert tensors too (gate_up_proj [E, 2I, D], down_proj
    [E, D, I]) by exposing them under the per-expert checkpoint names."""
    out = dict(hf)
    for name in list(hf):
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            get = hf[name]
            t = get()
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = (lambda t=t, e=e, i=inter: t[e, :i])
                out[f"{prefix}{e}.up_proj.weight"] = (lambda t=t, e=e, i=inter: t[e, i:])
            del out[name]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            t = hf[name]()
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = (lambda t=t, e=e: t[e])
            del out[name]
    return out


def gguf_tensors_from_hf(hf: Mapping[str, Callable[[], np.ndarray]], geom: N.Geometry
                         ) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (GGUF name, float32 array) in file order; `hf` maps HF names to loaders (lazy, so only one
    layer's tensors are in memory at a time)."""
    hf = _per_expert(hf)
    n_blocks = geom.num_hidden_layers + geom.nextn_layers
    inverse = N._inverse_map(n_blocks)
    kv_b_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in hf:
            raise Glm5labError(f"HF checkpoint has no tensor {name!r} (needed for the glm-dsa layout)")
        used.add(name)
        return np.asarray(hf[name](), dtype=np.float32)

    for gname, shape in N.gguf_tensor_specs(geom):
        bid = N.layer_of(gname)
        if bid is not None and gname in (N.tname(N.T.ATTN_K_B, bid), N.tname(N.T.ATTN_V_B, bid)):
            if bid not in kv_b_cache:
                kv_b = get(f"model.layers.{bid}.self_attn.kv_b_proj.weight")
                kv_b_cache[bid] = N.split_kv_b(kv_b, geom.num_attention_heads, geom.qk_nope_head_dim,
                                               geom.v_head_dim)
            k_b, v_b = kv_b_cache[bid]
            arr = k_b if gname == N.tname(N.T.ATTN_K_B, bid) else v_b
            if gname == N.tname(N.T.ATTN_V_B, bid):
                del kv_b_cache[bid]
        elif bid is not None and any(gname == N.tname(k, bid) for k in N.EXPERT_PROJ.values()):
            proj = next(p for p, k in N.EXPERT_PROJ.items() if gname == N.tname(k, bid))
            arr = np.stack([get(f"model.layers.{bid}.mlp.experts.{e}.{proj}.weight")
                            for e in range(geom.n_routed_experts)])
        else:
            hf_name = inverse.get(gname)
            if hf_name is None:
                raise Glm5labError(f"no HF tensor maps to {gname!r}")
            arr = get(hf_name)
        if tuple(arr.shape) != tuple(shape):
            raise Glm5labError(f"tensor {gname} has shape {tuple(arr.shape)}, the config implies {tuple(shape)}")
        yield gname, arr
    extra = sorted(set(hf) - used)
    if extra:
        raise Glm5labError(f"HF checkpoint has {len(extra)} tensors the glm-dsa layout does not use, e.g. {extra[0]!r}")


def hf_tensor_loaders(hf_dir: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Lazy float32 loaders for every tensor of an HF checkpoint directory (one or more safetensors)."""
    from safetensors import safe_open

    from glm5lab.model.checkpoint import safetensors_files, safetensors_keys

    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for f in safetensors_files(hf_dir):
        for key in safetensors_keys(f):
            def load(f=f, key=key):
                with safe_open(str(f), framework="pt") as s:
                    return s.get_tensor(key).float().numpy()
            loaders[key] = load
    return loaders


# ---------------------------------------------------------------- metadata

def add_model_metadata(w: gguf.GGUFWriter, config, qtype: str, name: str = "GLM-5",
                       nextn_layers: int | None = None) -> None:
    """general.* and glm-dsa.* keys, as llama.cpp's GlmMoeDsaModel.set_gguf_parameters writes them."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    g = N.Geometry.from_hf(config, nextn_layers=nextn_layers)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(g.num_hidden_layers + g.nextn_layers)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(1)  # MLA runs as MQA over the shared latent (llama.cpp's deepseek2 convention)
    rope = config.rope_parameters or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_group_count(config.n_group)
    w.add_expert_group_used_count(config.topk_group)
    w.add_leading_dense_block_count(config.first_k_dense_replace)
    w.add_q_lora_rank(config.q_lora_rank)
    w.add_kv_lora_rank(config.kv_lora_rank)
    w.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    w.add_value_length(config.kv_lora_rank)
    w.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    w.add_value_length_mla(config.v_head_dim)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_count(config.n_routed_experts)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_scale(float(config.routed_scaling_factor))
    if config.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(config.qk_rope_head_dim)
    if g.nextn_layers:
        w.add_nextn_predict_layers(g.nextn_layers)
    w.add_indexer_head_count(config.index_n_heads)
    w.add_indexer_key_length(config.index_head_dim)
    w.add_indexer_top_k(config.index_topk)
    if not all(g.indexer_full):  # llama.cpp's add_indexer_types; absent means every layer is "full"
        w.add_array(INDEXER_TYPES_KEY.format(arch=N.ARCH_NAME), list(g.indexer_full))
    ftype = FILE_TYPES.get(qtype.upper()) or getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}_M",
                                                     getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}", None))
    if ftype is not None:
        w.add_file_type(ftype)
    if qtype.upper() not in ("F32", "F16", "BF16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)


INDEXER_TYPES_KEY = "{arch}.attention.indexer.types"


def add_tokenizer_metadata(w: gguf.GGUFWriter, hf_dir: Path, config) -> None:
    """tokenizer.ggml.* from tokenizer.json: a byte-level BPE ("gpt2" model) with merges, like GLM's."""
    tok_path = Path(hf_dir) / "tokenizer.json"
    if not tok_path.exists():
        raise Glm5labError(f"{hf_dir}: no tokenizer.json")
    data = json.loads(tok_path.read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    n = config.vocab_size
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for tok, i in vocab.items():
        if i >= n:
            raise Glm5labError(f"{tok_path}: token id {i} >= vocab_size {n}")
        tokens[i] = tok
        if tok in added:
            types[i] = gguf.TokenType.CONTROL if added[tok].get("special") else gguf.TokenType.USER_DEFINED
        else:
            types[i] = gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    if config.eos_token_id is not None:
        eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        w.add_eos_token_id(int(eos))
    if config.bos_token_id is not None:
        w.add_bos_token_id(int(config.bos_token_id))
    if config.pad_token_id is not None:
        w.add_pad_token_id(int(config.pad_token_id))
    w.add_add_bos_token(False)
    template = None
    if (Path(hf_dir) / "chat_template.jinja").exists():
        template = (Path(hf_dir) / "chat_template.jinja").read_text()
    elif (Path(hf_dir) / "tokenizer_config.json").exists():
        template = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)


# ---------------------------------------------------------------- writing

def shard_paths(out_path: Path, n_shards: int) -> list[Path]:
    """llama.cpp's split names: <stem>-00001-of-0000N.gguf (the unsplit name when n_shards == 1)."""
    out_path = Path(out_path)
    if n_shards <= 1:
        return [out_path]
    return [out_path.with_name(gguf.gguf_writer.SHARD_NAME_FORMAT.format(out_path.stem, i + 1, n_shards))
            for i in range(n_shards)]


def _nbytes(shape, ttype: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[ttype]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def _partition(w: gguf.GGUFWriter, n_shards: int) -> None:
    """Spread the writer's tensors over exactly n_shards contiguous shards of near-equal tensor count
    (GGUFWriter's own split_max_* limits cannot promise an exact shard count)."""
    items = [kv for shard in w.tensors for kv in shard.items()]
    bounds = [round(i * len(items) / n_shards) for i in range(n_shards + 1)]
    w.tensors = [dict(items[bounds[i]:bounds[i + 1]]) for i in range(n_shards)]


def write_gguf(hf: Mapping[str, Callable[[], np.ndarray]], config, tokenizer_dir: Path, out_path: Path,
               qtype: str = "F16", n_shards: int = 1, progress: bool = True, name: str = "GLM-5") -> list[Path]:
    """Write the glm-dsa GGUF (or N shards) of HF tensors `hf`; returns the written paths."""
    qt = parse_qtype(qtype)
    out_path = Path(out_path)
    geom = N.Geometry.from_hf(config)
    specs = N.gguf_tensor_specs(geom)
    if n_shards < 1 or n_shards > len(specs):
        raise Glm5labError(f"n_shards must be between 1 and {len(specs)} (the tensor count), got {n_shards}")
    for target in shard_paths(out_path, n_shards):
        require_file_target(target)
        require_not_an_input(target, [p for p in Path(tokenizer_dir).iterdir() if p.is_file() and p.suffix != ".gguf"],
                             f"a file of the checkpoint folder {tokenizer_dir}")   # (a GGUF there is no input)
    make_folder(out_path.parent)
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=".gguf-tmp-", dir=out_path.parent))
    except OSError as exc:
        raise cannot_write_there(out_path.parent, exc) from None
    w = None
    try:
        w = gguf.GGUFWriter(tmp_dir / out_path.name, N.ARCH_NAME)
        add_model_metadata(w, config, qtype, name=name)
        add_tokenizer_metadata(w, tokenizer_dir, config)
        # Plan every tensor's type and size first (known from the config), write the headers, then
        # stream: one converted tensor in memory at a time, as the real 1.5 TB checkpoint needs.
        planned = {}
        for gname, shape in specs:
            ttype = tensor_type(gname, shape, qt)
            n = _nbytes(shape, ttype)
            planned[gname] = (ttype, n)
            if ttype in (QT.F32, QT.F16):
                w.add_tensor_info(gname, shape, np.dtype(np.float32 if ttype == QT.F32 else np.float16), n)
            else:
                w.add_tensor_info(gname, gguf.quant_shape_to_byte_shape(shape, ttype), np.dtype(np.uint8), n,
                                  raw_dtype=ttype)
        _partition(w, n_shards)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        it = gguf_tensors_from_hf(hf, geom)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, total=len(specs), desc=f"convert {qtype}", unit="tensor")
        for gname, arr in it:
            ttype, n = planned[gname]
            data = encode(arr, ttype)
            pending = next(iter(next(t for t in w.tensors if t)))
            if pending != gname or data.nbytes != n:
                raise Glm5labError(f"internal: writing {gname} ({data.nbytes} B) where {pending} ({n} B) is due")
            w.write_tensor_data(data)
        w.close()
        written = sorted(tmp_dir.iterdir())
        targets = shard_paths(out_path, n_shards)
        if [p.name for p in written] != [t.name for t in targets]:
            raise Glm5labError(f"writer produced {[p.name for p in written]}, expected {[t.name for t in targets]}")
        for src, dst in zip(written, targets):
            os.replace(src, dst)
        return targets
    finally:
        if w is not None:
            w.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def convert_hf_to_gguf(hf_dir: Path | str, out_path: Path | str, qtype: str = "F16", n_shards: int = 1,
                       progress: bool = True, name: str = "GLM-5") -> list[Path]:
    """HF checkpoint directory (config.json, *.safetensors, tokenizer.json) -> glm-dsa GGUF file(s)."""
    from glm5lab.model.checkpoint import read_hf_config

    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    if config.model_type != "glm_moe_dsa":
        raise Glm5labError(f"{hf_dir}: model_type {config.model_type!r} is not glm_moe_dsa")
    return write_gguf(hf_tensor_loaders(hf_dir), config, hf_dir, Path(out_path), qtype=qtype,
                      n_shards=n_shards, progress=progress, name=name)


def write_skeleton_gguf(config, out_path: Path | str, qtype: str = "Q4_K", nextn_layers: int = 0) -> Path:
    """A glm-dsa GGUF with real metadata and tensor table but a SPARSE (all-zero, unallocated) data
    section: what a file of `config` at `qtype` looks like to anything that reads headers, e.g. a
    400 GB GLM-5-shaped file that costs a few MB of disk. For inspection tests and demos only."""
    from glm5lab.gguf.inspect import ggml_type, nbytes, planned_type

    out_path = Path(out_path)
    qt = ggml_type(qtype)
    geom = N.Geometry.from_hf(config, nextn_layers=nextn_layers)
    fd, tmp = temp_beside(out_path)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, N.ARCH_NAME)
        add_model_metadata(w, config, qtype, name="GLM-5 skeleton (sparse, no weights)", nextn_layers=nextn_layers)
        data_bytes = 0
        for name, shape in N.gguf_tensor_specs(geom):
            t = planned_type(name, shape, qt)
            n = nbytes(shape, t)
            if t in (QT.F32, QT.F16):
                w.add_tensor_info(name, shape, np.dtype(np.float32 if t == QT.F32 else np.float16), n)
            else:
                w.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, t), np.dtype(np.uint8), n, raw_dtype=t)
            data_bytes += w.ggml_pad(n, w.data_alignment)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        with open(tmp, "r+b") as f:
            f.seek(0, os.SEEK_END)
            start = w.ggml_pad(f.tell(), w.data_alignment)
            f.truncate(start + data_bytes)
        os.replace(tmp, out_path)
        return out_path
    finally:
        tmp.unlink(missing_ok=True)
