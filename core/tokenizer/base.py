"""The `Tokenizer` interface every k3 vocabulary source implements.

A tokenizer is an id space `0 .. vocab_size-1` with a special-token table (name -> id). Two
families implement it:

- byte-level BPE (`ByteLevelTokenizer`: tiktoken files, byte-level `tokenizer.json`, the
  compact vocabulary): every id decodes to a fixed byte string and a decode is their
  concatenation (`byte_level = True`, `decode_bytes` exists);
- any other `tokenizer.json` (Metaspace / sentencepiece-style, WordPiece, byte-level BPE
  without all 256 byte tokens): the HF `tokenizers` object encodes and decodes
  (`WrappedHFTokenizer`, `byte_level = False`); a decode may join tokens with spaces.

This module holds what both share: the special-token table and the roles in it (BOS, EOS,
PAD, the chat format's end-of-message marker), looked up by name so code outside
`k3.tokenizer.specials` never spells an id.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterable, Mapping

from k3.tokenizer import specials


class Tokenizer:
    """Text <-> token ids for one vocabulary (see the module docstring).

    special_tokens: name -> id of every special token. roles: "bos" / "eos" / "pad" -> the
    name of the special token that plays it (a checkpoint's tokenizer_config.json), else
    Kimi's `[BOS]` / `[EOS]` / `[PAD]` when the table has them. eos_fallback: ids that end a
    generation when no special token is named EOS (the checkpoint config's `eos_token_id`);
    ids outside this vocabulary are left out.
    """

    byte_level: bool = True
    """Whether every id decodes to fixed bytes and a decode is their concatenation."""
    byte_fallback_ids: frozenset[int] = frozenset()
    """Ids of byte-fallback tokens (`<0xNN>`) a non-byte-level decoder joins run by run."""

    def __init__(self, *, special_tokens: Mapping[str, int], vocab_size: int, source: str,
                 roles: Mapping[str, str] | None = None, eos_fallback: Iterable[int] = ()):
        self.source = source
        self._vocab_size = int(vocab_size)
        for name, i in special_tokens.items():
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"{source}: special token {name!r} has id {i}, outside 0..{self._vocab_size - 1}")
        self._special: Mapping[str, int] = MappingProxyType(dict(special_tokens))
        self._special_names = {i: name for name, i in self._special.items()}
        if len(self._special_names) != len(self._special):
            raise ValueError(f"{source}: two special-token names share one id")
        self._special_ids = frozenset(self._special_names)
        self.flavor: str | None = specials.flavor_of(dict(self._special))
        """The chat format the special tokens name: "k3" (XTML, <|end_of_msg|>), "k2"
        (<|im_*|>, <|im_end|>), or None (neither end-of-message marker: no chat format)."""
        self._roles = {role: self._role(role, (roles or {}).get(role), source) for role in specials.ROLES}
        fallback = [int(i) for i in eos_fallback]
        self._eos_fallback = tuple(dict.fromkeys(i for i in fallback if 0 <= i < self._vocab_size))

    def _role(self, role: str, name: str | None, source: str) -> int | None:
        if name is not None:
            i = self._special.get(name)
            if i is None:
                i = self._regular_id(name)
            if i is None:
                raise ValueError(f"{source}: the tokenizer config names {name!r} as its {role}_token, "
                                 "but the vocabulary has no such token")
            return i
        return self._special.get(specials.KIMI_ROLE_NAMES[role])

    def _regular_id(self, name: str) -> int | None:
        """Id of a regular token spelt `name`, or None (for roles named outside the special table)."""
        try:
            return self.token_id(name)
        except KeyError:
            return None

    # --- the vocabulary ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids (regular + special); ids are 0 .. vocab_size-1."""
        return self._vocab_size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Special-token name -> id (read-only), reserved slots included."""
        return self._special

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def bos_id(self) -> int | None:
        """The BOS token's id, or None when the vocabulary has none."""
        return self._roles["bos"]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the chat format's end-of-message token (<|end_of_msg|>
        for "k3", <|im_end|> for "k2") first, then the EOS token; without a named EOS, the
        config's eos_token_id(s). May be empty."""
        ids = [self._special[specials.END_OF_MESSAGE[self.flavor]]] if self.flavor else []
        eos = self._roles["eos"]
        ids += [eos] if eos is not None else list(self._eos_fallback)
        return tuple(dict.fromkeys(ids))

    @property
    def pad_id(self) -> int | None:
        """The PAD token's id, or None when the vocabulary has none."""
        return self._roles["pad"]

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def missing_chat_markers(self) -> dict[str, tuple[str, ...]]:
        """Chat format -> the marker tokens it needs that this vocabulary lacks: only the
        format `flavor` names (empty when complete), or every format when flavor is None."""
        formats = (self.flavor,) if self.flavor else specials.FLAVORS
        return {f: tuple(m for m in specials.CHAT_MARKERS[f] if m not in self._special) for f in formats}

    # --- what a source implements --------------------------------------------------------------
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With `allow_special`, every special-token name in the text
        becomes its id; without, the text is encoded as plain text, names included. No BOS or
        other token is added."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens appear as their names (or not at all with
        `skip_special_tokens`)."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a special token: the UTF-8 of its name)."""
        raise NotImplementedError

    def token_id(self, name: str) -> int:
        """Id of a special token by name, or of a regular token by its spelling (the string
        `id_to_token` returns). KeyError if there is none."""
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str:
        """A special token's name, or a regular token's spelling in the vocabulary."""
        raise NotImplementedError

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.source} "
                             f"(0..{self._vocab_size - 1})")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.flavor or 'no chat format'} vocab={self.vocab_size} from {self.source}>"
