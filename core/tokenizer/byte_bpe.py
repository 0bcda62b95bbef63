"""`ByteLevelTokenizer`: the byte-level BPE vocabularies (tiktoken files, byte-level
`tokenizer.json`, the compact vocabulary).

Every id decodes to a fixed byte string: regular tokens to their BPE bytes, special tokens to
the UTF-8 of their name. Decoding is the concatenation of those bytes read as UTF-8 (invalid
bytes become U+FFFD), so nothing is ever inserted between tokens, special or not. Sources
differ only in how plain text (text with no special tokens recognised in it) becomes regular
ids: `_encode_ordinary`.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from k3.tokenizer import bytelevel
from k3.tokenizer.base import Tokenizer
from k3.tokenizer.pretokenize import split_for_encoding


class NotByteLevel(ValueError):
    """The vocabulary cannot be read as byte-level BPE (the message says why)."""


class ByteLevelTokenizer(Tokenizer):
    """Text <-> token ids for a byte-level BPE vocabulary.

    Subclasses pass the byte string of every id and the special-token table (name -> id) to
    `__init__` and implement `_encode_ordinary`. NotByteLevel if a regular token is missing
    for one of the 256 bytes.
    """

    byte_level = True

    def __init__(self, *, token_bytes: Sequence[bytes], special_tokens: Mapping[str, int], source: str,
                 roles: Mapping[str, str] | None = None, eos_fallback: Iterable[int] = ()):
        self._bytes: tuple[bytes, ...] = tuple(token_bytes)
        n = len(self._bytes)
        for name, i in special_tokens.items():
            if 0 <= i < n and self._bytes[i] != name.encode("utf-8"):
                raise ValueError(f"{source}: special token {name!r} (id {i}) does not decode to its name")
        special_ids = set(special_tokens.values())
        singles = {b for i, b in enumerate(self._bytes) if len(b) == 1 and i not in special_ids}
        if len(singles) < 256:
            missing = next(bytes([v]) for v in range(256) if bytes([v]) not in singles)
            raise NotByteLevel(f"{source}: byte-level BPE needs a regular token for each of the 256 bytes; "
                               f"{256 - len(singles)} are missing, e.g. {missing!r}")
        self._regular_ids: dict[str, int] | None = None   # byte-level spelling -> id, built on demand
        self._special_ids = frozenset(special_ids)          # token_id may run inside super().__init__
        self._special = special_tokens
        super().__init__(special_tokens=special_tokens, vocab_size=n, source=source, roles=roles,
                         eos_fallback=eos_fallback)
        # Longest names first, so a name that is a prefix of another never wins.
        names = sorted(self._special, key=lambda s: (-len(s), s))
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id decodes to (a special token: the UTF-8 of its name)."""
        self._check_id(token_id)
        return self._bytes[token_id]

    def token_id(self, name: str) -> int:
        """Id of a special token by name, or of a regular token by its byte-level spelling
        (the string `id_to_token` returns). KeyError if there is none."""
        i = self._special.get(name)
        if i is not None:
            return i
        if self._regular_ids is None:
            self._regular_ids = {bytelevel.to_chars(b): i for i, b in enumerate(self._bytes)
                                 if i not in self._special_ids}
        try:
            return self._regular_ids[name]
        except KeyError:
            raise KeyError(f"{name!r} is neither a special token nor a regular token of {self.source}") from None

    def id_to_token(self, token_id: int) -> str:
        """A special token's name, or a regular token's bytes spelt in the byte-level alphabet
        (e.g. " the" -> "Ġthe")."""
        token_id = int(token_id)
        self._check_id(token_id)
        name = self._special_names.get(token_id)
        return name if name is not None else bytelevel.to_chars(self._bytes[token_id])

    # --- encode / decode -----------------------------------------------------------------------
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With `allow_special`, every special-token name in the text
        becomes its id; without, the text is encoded as plain text, names included. No BOS or
        other token is added."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        text = valid_unicode(text)
        if not (allow_special and self._special_re):
            return self._encode_plain(text)
        ids: list[int] = []
        start = 0
        for m in self._special_re.finditer(text):
            if m.start() > start:
                ids += self._encode_plain(text[start:m.start()])
            ids.append(self._special[m.group()])
            start = m.end()
        if start < len(text):
            ids += self._encode_plain(text[start:])
        return ids

    def decode_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        """The concatenated bytes of `ids` (special tokens as their names unless skipped).
        `ids` may hold any integers (numpy, 0-d tensors)."""
        ids = list(map(int, ids))
        if ids and (min(ids) < 0 or max(ids) >= len(self._bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._bytes))
            self._check_id(bad)
        table = self._bytes
        if skip_special_tokens:
            skip = self._special_ids
            return b"".join([table[i] for i in ids if i not in skip])
        return b"".join([table[i] for i in ids])

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`: their bytes as UTF-8, invalid bytes as U+FFFD. Special tokens appear
        as their names (or not at all with `skip_special_tokens`); no spaces are inserted."""
        return self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", "replace")

    # --- for subclasses ------------------------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        """Regular ids of plain text (special-token names in it are plain text)."""
        raise NotImplementedError

    def _encode_plain(self, text: str) -> list[int]:
        pieces = split_for_encoding(text)
        if len(pieces) == 1:
            return self._encode_ordinary(text)
        return [i for piece in pieces for i in self._encode_ordinary(piece)]


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """`text` with lone surrogates (which UTF-8 cannot carry) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
