"""The one error of structured outputs: a spec that is malformed, that the backend cannot
compile, or whose compilation ran past the time limit. `field` names the request field."""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A structured-output spec the engine refuses (the server answers 400)."""

    def __init__(self, message: str, field: str = "structured_outputs"):
        self.field = field
        super().__init__(message)


def first_line(e: BaseException | str) -> str:
    """The first non-blank line of a backend's error message (at most 300 characters)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__
