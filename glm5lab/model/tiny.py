"""The tiny GLM-5: real MLA/DSA attention geometry, everything else small, random weights from a seed.

Public API (other modules code against exactly this):

    cache_root() -> Path                      # $GLM5LAB_CACHE or ~/.cache/glm5lab
    tiny_config(**overrides) -> GlmMoeDsaConfig
    build_tiny_model(seed=0) -> GlmMoeDsaForCausalLM   # float32, eval mode, deterministic
    build_tiny_tokenizer() -> tokenizers.Tokenizer     # byte-level BPE, vocab 512, deterministic
    ensure_tiny(root=None, qtypes=("F16", "Q8_0")) -> TinyPaths
        TinyPaths.hf_dir          # config.json, model.safetensors (per-expert on-disk names, like the
                                  # real GLM-5 checkpoint), tokenizer.json, tokenizer_config.json
        TinyPaths.gguf("Q8_0")    # llama.cpp `glm-dsa` GGUF of the same weights (F32/F16/BF16/Q8_0)
    TINY_GGUF_NAME, GENERATOR_VERSION
    glm5lab.model.probe.indexer_scores(model, ids) / attention_probs(model, ids)   # per-layer internals
    glm5lab.gguf.reader.hf_model_from_gguf(path)   # HF model with a GGUF's (dequantized) weights

Comparing an engine that serves the Q8_0 GGUF? Compare with hf_model_from_gguf(that file), not with
build_tiny_model(): Q8_0 weights alone move the top-k set in a few rows (measured vs fp32 on the 64-token
test prompt: 2/9/9 of 32 sparse rows in layers 0/1/2, greedy tokens 92% equal; F16: 0 rows, 100%).

Why the geometry is real and the rest is small: every kernel, cache layout and loader path under test
depends on kv_lora_rank 512, qk_rope 64, qk_nope 192, v_head 256, index_head_dim 128; nothing depends on
the hidden size, the number of layers or experts. index_topk is 32, so a 64-token prompt makes DSA select
a strict subset of the keys (rows at positions >= 32).

Why not the HF default init (std 0.02 everywhere): attention would be almost uniform and the indexer's
relu scores would tie at exactly zero, so "the top-k matches" would only test tie-breaking. The q/k paths
and the indexer get larger, symmetry-breaking weights so scores are well separated
(tests/test_tiny_model.py checks the k-th/(k+1)-th gaps and that attention is far from uniform).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from glm5lab.errors import Glm5labError
from glm5lab.files import make_folder

GENERATOR_VERSION = 2  # bump when the weights, tokenizer or file layout the generator writes change

TINY_DEFAULTS: dict = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    # GLM-5's real attention geometry:
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    index_head_dim=128,
    index_n_heads=8,
    index_topk=32,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=False,
    torch_dtype="float32",
)

SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_TOKEN = "<|endoftext|>"
TINY_GGUF_NAME = "GLM-5 tiny (glm5lab)"  # general.name of the tiny GGUFs

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Training text for the tiny BPE. Written for this package; any fixed text works, it only has to be
# deterministic and cover ordinary English so prompts tokenize into sensible pieces.
_TOKENIZER_TEXT = """
The model reads a prompt, one token at a time, and writes the next token. Attention lets every token
look back at the tokens before it. In multi-head latent attention the keys and values of each token are
compressed into one small latent vector of five hundred and twelve numbers plus a rotary part of sixty
four numbers, and the cache stores only that latent. The sparse indexer scores every earlier token with a
few light heads and keeps the top tokens; attention then reads only the tokens the indexer kept.
A quantized file stores each tensor in blocks; every block of thirty two numbers shares one scale.
The loader maps the names in the file to the names in the model, splits or joins tensors where the
layouts differ, and checks every shape before it copies a single byte. When something is wrong it says
which file and which tensor, in one line, and it leaves nothing half written behind.
Engineers who serve large models care about memory, bandwidth, latency and the exact same answer on
every run. They measure, write the numbers down, and keep the command that produced them.
Hello world. The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven,
eight, nine, ten. What is the capital of France? Paris is the capital of France. Tell me a story about
a small robot who learned to count the stars in the night sky over the sea.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "value", "list": [1, 2, 3], "ok": true}
"""


def cache_root() -> Path:
    """Where generated artifacts live: $GLM5LAB_CACHE, else ~/.cache/glm5lab."""
    env = os.environ.get("GLM5LAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "glm5lab"


def tiny_config(**overrides):
    """GlmMoeDsaConfig with GLM-5's attention geometry and a small everything-else."""
    from transformers import GlmMoeDsaConfig

    kwargs = dict(TINY_DEFAULTS)
    kwargs.update(_token_ids())
    kwargs.update(overrides)
    return GlmMoeDsaConfig(**kwargs)


def _token_ids() -> dict:
    tok = build_tiny_tokenizer()
    eos = tok.token_to_id(EOS_TOKEN)
    return dict(bos_token_id=None, eos_token_id=eos, pad_token_id=eos)


_TOKENIZER_CACHE = None


def build_tiny_tokenizer():
    """Byte-level BPE trained on the embedded text: vocab 512, same merges on every run."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is not None:
        return _TOKENIZER_CACHE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from glm5lab.gguf.tokenizer import glm4_pre_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = glm4_pre_tokenizer()  # GLM-4/GLM-5's split regex + byte-level, as the real one
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_DEFAULTS["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    text = _TOKENIZER_TEXT * 4
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    # The trainer may stop short of vocab_size on a small text; pad with unused tokens so the vocab is
    # exactly the config's (GGUF token arrays and the embedding must agree).
    n = tok.get_vocab_size()
    if n < TINY_DEFAULTS["vocab_size"]:
        tok.add_tokens([f"<|unused_{i}|>" for i in range(TINY_DEFAULTS["vocab_size"] - n)])
    assert tok.get_vocab_size() == TINY_DEFAULTS["vocab_size"], tok.get_vocab_size()
    _TOKENIZER_CACHE = tok
    return tok


def _init_std(name: str, hidden: int) -> tuple[str, float]:
    """(kind, scale) for one parameter. kinds: 'normal' std, 'one' = 1 + scale*N, 'zero' = scale*N."""
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return "one", 0.1                     # RMSNorms/LayerNorm: near 1, not all equal
    if name.endswith("k_norm.bias"):
        return "zero", 0.1
    if "embed_tokens" in name:
        return "normal", 1.0
    if name.endswith("lm_head.weight"):
        return "normal", 0.1                  # separated logits, so greedy tokens are not coin flips
    if "indexer.wq_b" in name:
        return "normal", 0.27                 # indexer q std ~3: relu scores well separated
    if "indexer.wk" in name:
        return "normal", 0.1
    if "indexer.weights_proj" in name:
        return "normal", 0.1                  # distinct, non-zero per-head weights
    if "q_a_proj" in name:
        return "normal", 0.06
    if "q_b_proj" in name:
        return "normal", 0.17                 # q std ~1.9
    if "kv_a_proj_with_mqa" in name:
        return "normal", 0.12                 # k_rope std ~1.9
    if "kv_b_proj" in name:
        return "normal", 0.084                # k_nope / v std ~1.9: logits std ~3, attention not uniform
    if "o_proj" in name:
        return "normal", 0.015                # attention adds ~ as much as the embedding: errors
                                              # (quantization, bf16) are not amplified layer to layer
    if "mlp.gate.weight" in name:
        return "normal", 0.1                  # router: experts chosen by clear margins
    return "normal", 0.04                     # MLPs, experts


def build_tiny_model(seed: int = 0, config=None):
    """GlmMoeDsaForCausalLM in float32 and eval mode; the same seed gives bit-identical weights."""
    import torch
    from transformers import GlmMoeDsaForCausalLM

    config = config or tiny_config()
    with torch.device("cpu"):
        model = GlmMoeDsaForCausalLM(config)
    model = model.to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            kind, scale = _init_std(name, config.hidden_size)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if kind == "one":
                p.copy_(1.0 + scale * noise)
            else:
                p.copy_(scale * noise)
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen, dtype=torch.float32))
    return model


def generator_fingerprint(seed: int = 0) -> str:
    """Content hash of everything that determines the generated files: config, tokenizer, chat template, seed,
    version, the generating functions' own source (a changed init rule is a new model even where nobody bumped
    GENERATOR_VERSION) and the libraries whose code shapes the files (transformers names the parameters, in whose
    order the random draws are made; gguf writes the GGUFs)."""
    import inspect
    from importlib.metadata import version

    from glm5lab.gguf.writer import WRITER_VERSION

    tok = build_tiny_tokenizer()
    code = "".join(inspect.getsource(f) for f in (tiny_config, _token_ids, build_tiny_tokenizer, _init_std,
                                                  build_tiny_model, hf_state_dict_on_disk, write_hf_checkpoint))
    payload = json.dumps(
        dict(version=GENERATOR_VERSION, writer=WRITER_VERSION, seed=seed, config=TINY_DEFAULTS,
             tokenizer=hashlib.sha256(tok.to_str().encode()).hexdigest(), chat_template=CHAT_TEMPLATE,
             code=hashlib.sha256(code.encode()).hexdigest(),
             libraries={name: version(name) for name in ("transformers", "gguf")}),
        sort_keys=True, default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TinyPaths:
    """Files of one generated tiny model. `gguf(qtype)` names the GGUF of that type (may not exist)."""

    root: Path
    fingerprint: str

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    def gguf(self, qtype: str = "F16") -> Path:
        return self.root / f"glm5-tiny-{qtype.upper()}.gguf"


def hf_state_dict_on_disk(model) -> dict:
    """The checkpoint layout the real GLM-5 ships (and vLLM's loader reads): one tensor per expert,
    `mlp.experts.{e}.{gate,up,down}_proj.weight`, instead of transformers' fused in-memory 3-D tensors."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def write_hf_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer files into out_dir (must not exist yet)."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    model = build_tiny_model(seed)
    out_dir.mkdir(parents=True)
    model.config.architectures = ["GlmMoeDsaForCausalLM"]
    model.config.save_pretrained(out_dir)
    save_file(hf_state_dict_on_disk(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tiny_tokenizer(), eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def ensure_tiny(root: Path | str | None = None, qtypes=("F16", "Q8_0"), seed: int = 0) -> TinyPaths:
    """Generate (once) and return the tiny HF checkpoint and its GGUFs.

    Files go to <root or cache_root()>/tiny/<fingerprint>/; the fingerprint hashes the generator's
    parameters, so a changed generator writes a new directory instead of reusing stale files. Every
    artifact is written to a temporary name and renamed into place, so a crash or a concurrent process
    never leaves (or reads) a half-written checkpoint.
    """
    base = Path(root) if root is not None else cache_root()
    if base.exists() and not base.is_dir():
        raise Glm5labError(f"{base}: is a file; the cache root must be a folder")
    fp = generator_fingerprint(seed)
    paths = TinyPaths(root=base / "tiny" / fp, fingerprint=fp)
    make_folder(paths.root)
    if not (paths.hf_dir / "model.safetensors").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".hf-tmp-", dir=paths.root))
        try:
            write_hf_checkpoint(tmp / "hf", seed)
            try:
                os.rename(tmp / "hf", paths.hf_dir)
            except OSError:
                if not (paths.hf_dir / "model.safetensors").exists():  # lost a race to a broken dir
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for qtype in qtypes:
        target = paths.gguf(qtype)
        if not target.exists():
            from glm5lab.gguf.writer import convert_hf_to_gguf

            convert_hf_to_gguf(paths.hf_dir, target, qtype=qtype, progress=False, name=TINY_GGUF_NAME)
    return paths
