"""The one error type users see.

Every refusal of bad input or a bad option raises :class:`MoeConvertError`. The CLI prints its text on
one line of stderr and exits with code 2; ``--debug`` shows the traceback as well.
"""

from __future__ import annotations


class MoeConvertError(Exception):
    """A user-facing error naming where the problem is and what was expected vs found.

    ``expected`` / ``found`` left out (None) are left out of the text too: a refusal that has nothing
    to compare says only what it found (or only what it wanted), never "expected None".
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        tensor: str | None = None,
        expected: object = None,
        found: object = None,
    ):
        self.message = message
        self.file = file
        self.tensor = tensor
        self.expected = expected
        self.found = found
        super().__init__(self.line())

    def what(self) -> str:
        """The message with its ``(expected X, found Y)`` part, without the file and tensor."""
        parts = [f"{label} {value}" for label, value in (("expected", self.expected), ("found", self.found))
                 if value is not None]
        return f"{self.message} ({', '.join(parts)})" if parts else self.message

    def line(self) -> str:
        where = ": ".join(str(p) for p in (self.file, self.tensor) if p)
        text = f"{where}: {self.what()}" if where else self.what()
        return " ".join(text.split())  # one line, always


class InternalError(RuntimeError):
    """A broken invariant of moeconvert itself (a bug), never a user mistake."""
