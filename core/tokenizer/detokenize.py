"""Streaming detokenisation: one `IncrementalDetokenizer` per request."""

from __future__ import annotations

import codecs
from typing import Iterable

from k3.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    """Turns a request's generated ids into text, a few ids at a time.

    `step(new_ids)` returns the text that became decodable; bytes of a UTF-8 character split
    across tokens are held back until the character is complete. U+FFFD appears only for bytes
    that cannot start or continue a valid character, and for an incomplete character still
    held when `finish()` flushes. Special tokens come out as their names (unless
    `skip_special_tokens`), with nothing inserted around them. The concatenation of every
    `step` and `finish()` equals `tokenizer.decode(all_ids, skip_special_tokens=...)`.
    Each step costs O(len(new_ids)); the sequence so far is never re-decoded.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._finished = False

    def step(self, new_ids: Iterable[int]) -> str:
        """Text newly decodable after appending `new_ids`."""
        if self._finished:
            raise RuntimeError("step() after finish()")
        data = self._tokenizer.decode_bytes(new_ids, skip_special_tokens=self._skip)
        return self._utf8.decode(data, final=False)

    def finish(self) -> str:
        """Flush the bytes held back (an incomplete character becomes U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        return self._utf8.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        """Bytes held back for an incomplete character."""
        return len(self._utf8.getstate()[0])


class NoDetokenizer:
    """The detokenizer of an engine started without a tokenizer (`skip_tokenizer_init`):
    outputs carry token ids only, their text stays empty."""

    pending_bytes = 0

    def step(self, new_ids: Iterable[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""
