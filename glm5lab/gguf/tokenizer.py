"""Rebuild the HF (tokenizers) tokenizer from a glm-dsa GGUF's tokenizer.ggml.* metadata.

transformers 5.19 refuses `AutoTokenizer.from_pretrained(..., gguf_file=...)` for architecture glm-dsa
("not supported yet"), so a GGUF alone could not be tokenized. GLM's tokenizer is a byte-level BPE
(`tokenizer.ggml.model` "gpt2", pre-tokenizer "glm4": llama.cpp splits with the llama-3 regex), which
the `tokenizers` library rebuilds exactly from the token list and merges.
"""
from __future__ import annotations

from pathlib import Path

from glm5lab.errors import Glm5labError
from glm5lab.files import make_folder

# llama.cpp's LLAMA3 / GLM4 pre-tokenizer split pattern (llama-vocab.cpp), also GLM-4/5's tokenizer.json.
GLM4_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def glm4_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def tokenizer_from_gguf(path_or_set):
    """transformers.PreTrainedTokenizerFast equivalent to the GGUF's tokenizer (vocab, merges, special
    tokens, eos/pad, chat template)."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from glm5lab.gguf.reader import open_gguf

    s = open_gguf(path_or_set)
    model = s.meta("tokenizer.ggml.model")
    if model != "gpt2":
        raise Glm5labError(f"{s.paths[0]}: tokenizer.ggml.model {model!r} is not the byte-level BPE ('gpt2') GLM uses")
    tokens = s.meta("tokenizer.ggml.tokens")
    types = s.meta("tokenizer.ggml.token_type")
    merges = s.meta("tokenizer.ggml.merges") or []
    special_types = {int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.UNUSED)}
    vocab = {t: i for i, t in enumerate(tokens)}  # every id in place; added tokens re-marked below
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               ignore_merges=False))
    pre = s.meta("tokenizer.ggml.pre")
    tok.pre_tokenizer = (glm4_pre_tokenizer() if pre in ("glm4", "llama-bpe", "llama3")
                         else pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.decoder = decoders.ByteLevel()
    # control / user-defined tokens are matched whole, before BPE (they keep their vocab ids)
    for i, t in enumerate(tokens):
        if int(types[i]) == int(gguf.TokenType.CONTROL):
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        elif int(types[i]) in special_types:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise Glm5labError(f"{s.paths[0]}: rebuilt tokenizer has {tok.get_vocab_size(with_added_tokens=True)} "
                           f"tokens, the file lists {len(tokens)}")
    eos_id = s.meta("tokenizer.ggml.eos_token_id")
    pad_id = s.meta("tokenizer.ggml.padding_token_id")
    bos_id = s.meta("tokenizer.ggml.bos_token_id")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        pad_token=tokens[pad_id] if pad_id is not None else None,
        bos_token=tokens[bos_id] if bos_id is not None else None,
    )
    template = s.meta("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def write_hf_tokenizer(path_or_set, out_dir: Path | str) -> Path:
    """Save the GGUF's tokenizer as HF files (tokenizer.json, tokenizer_config.json) into out_dir."""
    out_dir = make_folder(out_dir)
    tokenizer_from_gguf(path_or_set).save_pretrained(out_dir)
    return out_dir
