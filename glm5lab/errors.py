"""One exception type for every problem a user can fix (bad file, wrong version, unsupported shape).

The CLI prints these as one line and exits non-zero; anything else is a bug and keeps its traceback.
"""


class Glm5labError(Exception):
    """A problem with the user's input or environment, stated in one line that names it."""
