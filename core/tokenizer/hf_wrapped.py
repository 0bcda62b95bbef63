"""Source (b'): a `tokenizer.json` that is not byte-level BPE, wrapped whole.

Metaspace / sentencepiece-style files (Unigram or BPE with a "▁" word marker, byte fallback
tokens `<0xNN>`), WordPiece files, or byte-level BPE without a token for every byte: k3's
byte-level machinery cannot represent them (a token's text depends on its neighbours: the
decoder strips the first word marker, joins WordPiece words with spaces, merges byte-fallback
bytes), so the HF `tokenizers` object itself encodes and decodes. Its `added_tokens` are the
special-token table (every added token counts as special, as for byte-level files); its
post-processor (BOS / CLS added on encode), truncation and padding are removed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping

from tokenizers import Tokenizer as HFTokenizerCore

from k3.tokenizer.base import Tokenizer
from k3.tokenizer.byte_bpe import valid_unicode
from k3.tokenizer.hf_vocab import added_tokens

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class WrappedHFTokenizer(Tokenizer):
    """Any `tokenizer.json`, encoded and decoded by the `tokenizers` package (`byte_level` is
    False: decodes are not concatenations of per-token bytes; `IncrementalDetokenizer` streams
    them by decoding a window of recent ids). data: the parsed file; roles and eos_fallback
    as `Tokenizer` takes them."""

    byte_level = False

    def __init__(self, path: Path, *, data: dict, roles: Mapping[str, str] | None = None,
                 eos_fallback: Iterable[int] = ()):
        table = added_tokens(data, path)
        plain = dict(data, post_processor=None, truncation=None, padding=None)
        try:
            self._hf = HFTokenizerCore.from_str(json.dumps(plain))
            self._hf_literal = HFTokenizerCore.from_str(json.dumps(plain))
        except Exception as e:   # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: the tokenizers package cannot load it: {e}") from None
        # Special-token names in text stay text (allow_special=False). Added tokens the file
        # does not flag special are still matched there: `tokenizers` has no switch for them.
        self._hf_literal.encode_special_tokens = True
        vocab = self._hf.get_vocab(with_added_tokens=True)
        size = max([*vocab.values(), *table.values(), -1]) + 1
        if size == 0:
            raise ValueError(f"{path}: the vocabulary is empty")
        self._special_set = frozenset(table.values())
        self.byte_fallback_ids = frozenset(i for piece, i in vocab.items()
                                           if _BYTE_FALLBACK.fullmatch(piece) and i not in self._special_set)
        super().__init__(special_tokens=table, vocab_size=size, source=str(path), roles=roles,
                         eos_fallback=eos_fallback)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text` (see `Tokenizer.encode`); the file's normaliser and
        pre-tokeniser apply to the whole text, so a Metaspace "first" prefix goes only before
        its start."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        hf = self._hf if allow_special else self._hf_literal
        return hf.encode(valid_unicode(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The file's decoder over `ids` (spaces between WordPiece words, "▁" as a space, the
        first word's marker stripped, byte-fallback bytes joined; invalid UTF-8 as U+FFFD).
        With `skip_special_tokens`, every special token (added token) is dropped first."""
        ids = list(map(int, ids))
        for i in ids:
            self._check_id(i)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_set]
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for on its own: a byte-fallback token `<0xNN>` its byte,
        else the UTF-8 of its standalone decode (a special token: its name). Spaces the decoder
        puts between tokens in context are not part of it."""
        token_id = int(token_id)
        self._check_id(token_id)
        name = self._special_names.get(token_id)
        if name is not None:
            return name.encode("utf-8")
        piece = self._hf.id_to_token(token_id)
        m = _BYTE_FALLBACK.fullmatch(piece or "")
        if m:
            return bytes([int(m.group(1), 16)])
        return self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_id(self, name: str) -> int:
        """Id of a special token by name, or of a regular token by its vocabulary spelling
        (e.g. "▁the", "##ing"). KeyError if there is none."""
        i = self._special.get(name)
        if i is None:
            i = self._hf.token_to_id(name)
        if i is None:
            raise KeyError(f"{name!r} is neither a special token nor a regular token of {self.source}")
        return i

    def id_to_token(self, token_id: int) -> str:
        """A special token's name, or a regular token's spelling in the vocabulary."""
        token_id = int(token_id)
        self._check_id(token_id)
        name = self._special_names.get(token_id)
        if name is not None:
            return name
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise KeyError(f"id {token_id} has no token in {self.source}")
        return piece
