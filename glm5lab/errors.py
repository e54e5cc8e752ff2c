"""One exception type for every problem a user can fix (bad file, wrong version, unsupported shape).

The CLI prints these as one line and exits non-zero; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import sys


class Glm5labError(Exception):
    """A problem with the user's input or environment, stated in one line that names it."""


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
