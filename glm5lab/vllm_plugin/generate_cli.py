"""`glm5lab generate`: GLM-5 (the tiny one, an HF directory or a GGUF) generating greedily in vLLM through
glm5lab, printing which attention backend and indexer vLLM used. Heavy imports stay inside `_run`."""
from __future__ import annotations

from glm5lab.cli import stdout_to_stderr


def _run(args) -> int:
    import json

    from glm5lab.vllm_plugin.generate import run

    with stdout_to_stderr(args.json):
        result = run(args.model, prompts=args.prompt or ["The model reads a prompt"], max_tokens=args.max_tokens,
                     gguf=args.gguf, qtype=args.qtype, dtype=args.dtype, tokenizer=args.tokenizer)
    if args.json:
        out = {k: v for k, v in result.__dict__.items() if k != "first_step_logprobs"}
        print(json.dumps(out, indent=2))
        return 0
    print(result.summary())
    for prompt, ids, text in zip(result.prompt_token_ids, result.token_ids, result.texts):
        shown = repr(text) if text is not None else ""
        print(f"prompt {len(prompt)} tokens -> {ids} {shown}")
    print(f"{result.seconds:.1f} s for {sum(len(t) for t in result.token_ids)} tokens "
          f"(CPU numbers are not performance)")
    return 0


def _at_least_one(text: str) -> int:
    """argparse type: refused at parse time, before an engine starts (~15 s) only for vLLM to reject it."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_command(sub) -> None:
    p = sub.add_parser("generate", help="generate greedily with vLLM through glm5lab's sparse-MLA backend "
                                        "and DSA indexer (CPU or GPU)")
    p.add_argument("--model", default="tiny", help="'tiny' (glm5lab's tiny GLM-5), an HF directory or a .gguf")
    p.add_argument("--gguf", action="store_true", help="with --model tiny: load its GGUF through "
                                                        "vllm-gguf-plugin + glm5lab's adapter")
    p.add_argument("--qtype", default="F16", help="GGUF type of the tiny model with --gguf (F16, Q8_0)")
    p.add_argument("--tokenizer", default=None, help="folder with the model's tokenizer (default: the HF "
                                                         "directory, or a tokenizer.json beside the .gguf)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=_at_least_one, default=8, help="tokens to generate a prompt (>= 1; default 8)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                   help="model dtype (default float16, the original deployment's: vLLM's GGUF path ran SM120 in "
                        "fp16; `vllm serve` on a GGUF defaults to bfloat16)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)
