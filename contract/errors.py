"""The one error type of the build stage: a cause a person can read and a remedy they can apply.

The CLI prints ``str(error)`` as a single line on stderr and exits with ``exit_code``; nothing
that is the user's doing (bad input, a full disk, a missing GPU) ever shows a traceback.
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2  # the user can fix it by changing the command or its inputs
EXIT_FAILURE = 1  # the environment failed us (disk full, a verify mismatch)


class BuildError(Exception):
    """A build-stage failure with its cause and the remedy, printed as one line."""

    def __init__(self, cause: str, remedy: str = "", *, exit_code: int = EXIT_BAD_INPUT) -> None:
        # Newlines would break the one-line contract (messages often embed library errors).
        self.cause = " ".join(str(cause).split())
        self.remedy = " ".join(str(remedy).split())
        self.exit_code = exit_code
        super().__init__(self.cause)

    def __str__(self) -> str:
        if self.remedy:
            return f"error: {self.cause} — {self.remedy}"
        return f"error: {self.cause}"
