"""Incremental XTML lexer: text in, plain-text pieces and complete markers out.

A marker is ``<|open|>NAME[ key="val" ...]<|sep|>``, ``<|close|>NAME<|sep|>`` or
``<|end_of_msg|>``. Whitespace is tolerated around the name and before ``<|sep|>`` (vLLM's
parsers accept ``<|open|> tools <|sep|>`` for detokenisers that put spaces between special
tokens). Anything else, including a stray ``<|sep|>``, other ``<|...|>`` strings (K2 tokens) and
heads that do not parse, is plain text.

Streaming: :meth:`XtmlLexer.feed` returns every piece it can decide now and holds back a tail that
could still become a marker (``"<|clo"``, ``"<|open|>call tool=\\"x"``...). The decision at each
position depends only on the text, never on how it was split, so any split of the same text yields
the same markers and the same concatenated text. A marker head longer than :data:`MAX_HEAD`
characters is plain text, which bounds how much is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3.chat.xtml import CLOSE, END_OF_MSG, OPEN, SEP, unescape_attr

#: Longest marker (from ``<|open|>`` to the end of ``<|sep|>``) the lexer recognises.
MAX_HEAD = 512

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_MARKER, _TEXT, _MORE = 0, 1, 2


@dataclass(frozen=True)
class Marker:
    """One complete marker. ``kind`` is ``"open"``, ``"close"`` or ``"eom"`` (``<|end_of_msg|>``);
    ``attrs`` are unescaped; ``raw`` is the exact source text (joining raws gives the input back)."""

    kind: str
    name: str
    raw: str
    attrs: dict[str, str] = field(default_factory=dict, compare=False)

    def is_(self, kind: str, name: str) -> bool:
        return self.kind == kind and self.name == name



class XtmlLexer:
    """Split streamed text into ``str`` pieces and :class:`Marker` objects (see module doc)."""

    def __init__(self) -> None:
        self._buf = ""

    def feed(self, text: str) -> list[str | Marker]:
        """Tokens decidable after appending ``text``; a possible marker prefix is held back."""
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list[str | Marker]:
        """Flush at end of stream: a held-back incomplete marker becomes plain text."""
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[str | Marker]:
        buf, out = self._buf, []
        pos = text_start = 0
        while True:
            i = buf.find("<", pos)
            if i < 0:
                break
            status, marker, end = _match_at(buf, i, final)
            if status == _MORE:
                if i > text_start:
                    out.append(buf[text_start:i])
                self._buf = buf[i:]
                return out
            if status == _MARKER:
                if i > text_start:
                    out.append(buf[text_start:i])
                out.append(marker)
                pos = text_start = end
            else:
                pos = i + 1
        if len(buf) > text_start:
            out.append(buf[text_start:])
        self._buf = ""
        return out


def lex(text: str) -> list[str | Marker]:
    """All tokens of a complete text (non-streaming convenience)."""
    lexer, out = XtmlLexer(), []
    for tok in lexer.feed(text) + lexer.finish():
        if out and isinstance(tok, str) and isinstance(out[-1], str):
            out[-1] += tok
        else:
            out.append(tok)
    return out


def _match_at(buf: str, i: int, final: bool) -> tuple[int, Marker | None, int]:
    """Classify ``buf[i:]`` (which starts with ``<``): a marker, plain text, or undecided."""
    if buf.startswith(END_OF_MSG, i):
        return _MARKER, Marker("eom", "", END_OF_MSG), i + len(END_OF_MSG)
    for lit, kind in ((OPEN, "open"), (CLOSE, "close")):
        if buf.startswith(lit, i):
            return _head(buf, i, i + len(lit), kind, final)
    if not final and len(buf) - i < len(END_OF_MSG):  # a prefix of a literal can only end the buffer
        tail = buf[i:]
        if any(lit.startswith(tail) for lit in (OPEN, CLOSE, END_OF_MSG)):
            return _MORE, None, 0
    return _TEXT, None, 0


def _head(buf: str, start: int, j: int, kind: str, final: bool) -> tuple[int, Marker | None, int]:
    """Parse ``NAME[ key="val"...]<|sep|>`` after ``<|open|>`` / ``<|close|>`` at ``start``."""
    end = min(len(buf), start + MAX_HEAD)  # never look past the head limit
    more = (_TEXT if final or len(buf) >= start + MAX_HEAD else _MORE), None, 0
    no = _TEXT, None, 0

    j = _skip_ws(buf, j, end)
    k = _skip_name(buf, j, end)
    if k >= end:
        return more
    if k == j:
        return no
    name, attrs = buf[j:k], {}
    while True:
        m = _skip_ws(buf, k, end)
        if m >= end:
            return more
        if buf.startswith(SEP, m, end):
            stop = m + len(SEP)
            return _MARKER, Marker(kind, name, buf[start:stop], attrs), stop
        if SEP.startswith(buf[m:end]):  # a partial <|sep|> at the end of what we have
            return more
        if kind == "close" or m == k:  # close markers take no attributes; attributes need a space
            return no
        a = _skip_name(buf, m, end)
        if a >= end:
            return more
        if a == m or buf[a] != "=":
            return no
        if a + 1 >= end:
            return more
        if buf[a + 1] != '"':
            return no
        q = buf.find('"', a + 2, end)
        special = buf.find("<|", a + 2, end if q < 0 else q)
        if special >= 0:  # a special token inside a value: not a marker
            return no
        if q < 0:
            return more
        attrs[buf[m:a]] = unescape_attr(buf[a + 2 : q])
        k = q + 1


def _skip_ws(buf: str, j: int, end: int) -> int:
    while j < end and buf[j].isspace():
        j += 1
    return j


def _skip_name(buf: str, j: int, end: int) -> int:
    while j < end and buf[j] in _NAME_CHARS:
        j += 1
    return j
