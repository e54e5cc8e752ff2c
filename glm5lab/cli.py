"""The `glm5lab` command. Each subcommand lives beside the code it drives and adds itself here.

A subcommand module defines `add_command(subparsers)`, which adds a parser whose `func(args)` returns
an exit code. Modules are imported to build the parser, so they keep torch/vLLM imports inside `func`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from glm5lab.errors import Glm5labError

SUBCOMMAND_MODULES = [
    "glm5lab.env_cli",
    "glm5lab.notebooks",
    "glm5lab.gguf.cli",
    "glm5lab.vllm_plugin.doctor_cli",
    "glm5lab.bench.cli",
    "glm5lab.vllm_plugin.loader_cli",
    "glm5lab.vllm_plugin.generate_cli",
]


def first_paragraph(doc: str | None) -> str:
    """A module docstring's first paragraph, for a script's --help: its first line alone can stop mid-sentence."""
    return (doc or "").strip().split("\n\n")[0]


@contextlib.contextmanager
def stdout_to_stderr(active: bool = True):
    """File descriptor 1 pointed at 2 for the block (when active): a `--json` document must be all a command
    prints on stdout, and vLLM logs there, as do the CPU kernels' C++ libraries, which only a descriptor reaches."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def build_parser() -> argparse.ArgumentParser:
    from glm5lab import __version__

    parser = argparse.ArgumentParser(
        prog="glm5lab",
        description="GLM-5 GGUF on vLLM without a sparse-MLA backend: GGUF tools, loader plugin, "
                    "backend doctor, Triton sparse-MLA kernels, benchmarks.")
    parser.add_argument("--version", action="version", version=f"glm5lab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Glm5labError as exc:
        print(f"glm5lab {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("glm5lab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `glm5lab gguf inspect X | head`: the reader left; say nothing more, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would raise again
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by the closed pipe


if __name__ == "__main__":
    sys.exit(main())
