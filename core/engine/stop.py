"""Stop strings over a text stream, including strings that span tokens.

Text that could still be the start of a stop string is held back, so nothing past a stop
string is ever emitted; the stop string itself is not emitted either (OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped: str | None = None          # the stop string that ended the stream

    def push(self, text: str) -> str:
        """Add generated text; returns the text that is now safe to emit."""
        if self.stopped is not None:
            return ""
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, stop = min(hits)
            self.stopped, self.pending = stop, ""
            return buf[:at]
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """End of stream without a stop string: the held-back text."""
        out, self.pending = self.pending, ""
        return out
