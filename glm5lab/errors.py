"""One exception type for every problem a user can fix (bad file, wrong version, unsupported shape).

The CLI prints these as one line and exits non-zero; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import sys


class Glm5labError(Exception):
    """A problem with the user's input or environment, stated in one line that names it."""


def first_line(exc: BaseException, limit: int = 240) -> str:
    """`Type: message` of an exception from a library, on one line for a Glm5labError to quote. transformers'
    validation errors put the field on their first line and the reason ("expected int, got str") on the next, so a
    first line ending in ':' takes the next non-empty one with it."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    head = text[0] if text else ""
    if head.endswith(":") and len(text) > 1:
        head = f"{head} {text[1]}"
    return f"{type(exc).__name__}: {head[:limit]}"


def one_line_errors(main):
    """For a script's `main(argv) -> int` (the `python -m glm5lab.bench.*` tools): a Glm5labError becomes
    `error: <message>` on stderr and exit status 1."""
    @functools.wraps(main)
    def run(argv=None) -> int:
        try:
            return main(argv)
        except Glm5labError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return run
