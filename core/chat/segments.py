"""A rendered prompt as segments: special tokens apart from ordinary text.

``render_*_chat`` return the joined string. A server that tokenizes the string with
``allow_special=True`` turns marker text inside user content (``<|close|>message<|sep|>``) into
real special tokens: prompt injection. Encoding the segments instead (specials as special tokens,
text with specials disallowed, each segment on its own, the way the upstream K3 renderer feeds
its BPE) avoids that and follows the upstream token boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A piece of the prompt: one special token (``special=True``) or ordinary text."""

    text: str
    special: bool = False


class SegmentWriter:
    """Collects segments; empty text is skipped."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def special(self, token: str) -> None:
        self.segments.append(Segment(token, True))

    def text(self, text: str) -> None:
        if text:
            self.segments.append(Segment(text))

    def joined(self) -> str:
        return "".join(s.text for s in self.segments)


def encode_segments(tokenizer, segments: list[Segment]) -> list[int]:
    """Token ids of a rendered prompt: each special segment is exactly one special token, text
    segments are encoded with special tokens disallowed (their marker text stays text)."""
    ids: list[int] = []
    for seg in segments:
        piece = tokenizer.encode(seg.text, allow_special=seg.special)
        if seg.special and len(piece) != 1:
            raise ValueError(f"{seg.text!r} is not a special token of this tokenizer")
        ids += piece
    return ids
