"""Streaming detokenisation: one `IncrementalDetokenizer` per request."""

from __future__ import annotations

import codecs
import os
from typing import Iterable

from k3.tokenizer.base import Tokenizer

# Ids a wrapped (non-byte-level) tokenizer re-decodes before the first new one: enough context
# for its decoder's joins (a WordPiece space, a Metaspace marker) and for a character whose
# byte-fallback tokens are still arriving (UTF-8 needs at most 4).
_CONTEXT_IDS = 6


class IncrementalDetokenizer:
    """Turns a request's generated ids into text, a few ids at a time.

    `step(new_ids)` returns the text that became decodable; bytes of a UTF-8 character split
    across tokens are held back until the character is complete. U+FFFD appears only for bytes
    that cannot start or continue a valid character, and for an incomplete character still
    held when `finish()` flushes. Special tokens come out as their names (unless
    `skip_special_tokens`), with nothing inserted around them. The concatenation of every
    `step` and `finish()` equals `tokenizer.decode(all_ids, skip_special_tokens=...)`.

    A byte-level tokenizer streams its bytes: each step costs O(len(new_ids)) and the sequence
    so far is never re-decoded. A wrapped tokenizer (`byte_level` False) re-decodes a window
    of the last few emitted ids with the new ones and emits what the window's text gained
    (vLLM's prefix / read offsets); text ending in U+FFFD is held back until more ids come, and
    a window never starts inside a run of byte-fallback tokens. The equality with `decode`
    then holds for every id sequence whose byte-fallback runs are valid UTF-8; HF's decoder
    turns a whole invalid run into U+FFFDs, so after an invalid run the stream may keep a
    character that a full decode replaces.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._finished = False
        if tokenizer.byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        else:
            self._ids: list[int] = []   # kept ids (special tokens already dropped when skipped)
            self._prefix = 0            # window start: ids before it are fully emitted
            self._read = 0              # ids whose text has been emitted

    def step(self, new_ids: Iterable[int]) -> str:
        """Text newly decodable after appending `new_ids`."""
        if self._finished:
            raise RuntimeError("step() after finish()")
        if self._tokenizer.byte_level:
            data = self._tokenizer.decode_bytes(new_ids, skip_special_tokens=self._skip)
            return self._utf8.decode(data, final=False)
        return self._window(new_ids, final=False)

    def finish(self) -> str:
        """Flush what was held back (an incomplete character becomes U+FFFD)."""
        if self._finished:
            return ""
        text = self._utf8.decode(b"", final=True) if self._tokenizer.byte_level else self._window((), final=True)
        self._finished = True
        return text

    @property
    def pending_bytes(self) -> int:
        """Bytes held back for an incomplete character (a wrapped tokenizer: the UTF-8 bytes
        of the held ids)."""
        if self._tokenizer.byte_level:
            return len(self._utf8.getstate()[0])
        return sum(len(self._tokenizer.token_bytes(i)) for i in self._ids[self._read:])

    def _window(self, new_ids: Iterable[int], *, final: bool) -> str:
        tok = self._tokenizer
        new = [int(i) for i in new_ids]
        if self._skip:
            new = [i for i in new if not tok.is_special(i)]
        self._ids += new
        if self._read == len(self._ids):
            return ""
        done = tok.decode(self._ids[self._prefix:self._read])
        text = tok.decode(self._ids[self._prefix:])
        if not final and (text.endswith("\ufffd") or not text.startswith(done)):
            return ""   # a character is still arriving, or the decoder still rewrites the window
        self._read = len(self._ids)
        start = max(self._prefix, self._read - _CONTEXT_IDS)
        byte_ids = tok.byte_fallback_ids   # a window must not start inside a run of byte tokens:
        while start > self._prefix and self._ids[start] in byte_ids and self._ids[start - 1] in byte_ids:
            start -= 1                     # HF decodes such a run whole (or each byte as U+FFFD)
        self._prefix = start
        if not text.startswith(done):   # finish(): the text after what both decodes share
            return text[len(os.path.commonprefix([done, text])):]
        return text[len(done):]


class NoDetokenizer:
    """The detokenizer of an engine started without a tokenizer (`skip_tokenizer_init`):
    outputs carry token ids only, their text stays empty."""

    pending_bytes = 0

    def step(self, new_ids: Iterable[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""
