"""Source (b): a `tokenizer.json` (HF `tokenizers`), Kimi-Linear style.

A byte-level BPE file (ByteLevel decoder, a regular token for each of the 256 bytes) loads as
`HFTokenizer`: the file's model, normaliser and pre-tokeniser encode plain text through the
`tokenizers` package; its `added_tokens` become the special-token table (every added token
counts as special); k3 splits them out itself (`ByteLevelTokenizer.encode`), so they are removed
from the `tokenizers` object, as are its post-processor (no BOS is added), truncation and
padding. Regular tokens decode through the byte-level alphabet (`bytelevel.py`). Any other file
raises `NotByteLevel` here and is wrapped whole instead (`hf_wrapped.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizerCore

from k3.tokenizer import bytelevel, specials
from k3.tokenizer.byte_bpe import ByteLevelTokenizer, NotByteLevel
from k3.tokenizer.tiktoken_vocab import read_json

TOKENIZER_JSON = "tokenizer.json"


def added_tokens(data: dict, path: Path) -> dict[str, int]:
    """The special-token table of a parsed `tokenizer.json`: every `added_tokens` entry."""
    added: dict[str, int] = {}
    for entry in data.get("added_tokens") or []:
        try:
            name, i = entry["content"], int(entry["id"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: malformed added_tokens entry {json.dumps(entry)[:80]}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{path}: added_tokens entry {json.dumps(entry)[:80]} has no content")
        if name in added:
            raise ValueError(f"{path}: added token {name!r} is listed twice")
        added[name] = i
    return added


class HFTokenizer(ByteLevelTokenizer):
    """A byte-level BPE `tokenizer.json` (NotByteLevel for any other kind of file). data: the
    parsed file when the caller has read it; roles and eos_fallback as `Tokenizer` takes them."""

    def __init__(self, path: Path, *, data: dict | None = None, roles: Mapping[str, str] | None = None,
                 eos_fallback: Iterable[int] = ()):
        data = read_json(path) if data is None else data
        model = data.get("model")
        if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise NotByteLevel(f"{path}: not a BPE model with a 'vocab' mapping")
        if not _is_byte_level(data.get("decoder")):
            raise NotByteLevel(f"{path}: not byte-level BPE (decoder is {json.dumps(data.get('decoder'))[:80]})")
        by_id: dict[int, bytes] = {}
        for token, i in model["vocab"].items():
            try:
                by_id[int(i)] = bytelevel.from_chars(token)
            except ValueError as e:
                raise NotByteLevel(f"{path}: model.vocab: {e}") from None
        added = added_tokens(data, path)
        for name, i in added.items():
            by_id[i] = name.encode("utf-8")
        first_special = min(added.values(), default=max(by_id, default=-1) + 1)
        for i in range(max(by_id, default=-1) + 1):   # unnamed special slots, as in Kimi's tiktoken files
            if i not in by_id:
                if i < first_special:
                    raise NotByteLevel(f"{path}: id {i} is missing from model.vocab")
                added[specials.reserved_name(i)] = i
                by_id[i] = specials.reserved_name(i).encode("utf-8")
        super().__init__(token_bytes=[by_id[i] for i in range(len(by_id))], special_tokens=added,
                         source=str(path), roles=roles, eos_fallback=eos_fallback)
        plain = dict(data, added_tokens=[], post_processor=None, truncation=None, padding=None)
        try:
            self._hf = HFTokenizerCore.from_str(json.dumps(plain))
        except Exception as e:   # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: the tokenizers package cannot load it: {e}") from None

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids


def _is_byte_level(decoder: object) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return decoder.get("type") == "Sequence" and any(_is_byte_level(d) for d in decoder.get("decoders", []))


def write_tokenizer_json(path: Path, regular: Sequence[bytes], merges: Sequence[tuple[bytes, bytes]],
                         special_tokens: Mapping[str, int], *, pattern: str) -> Path:
    """Write a byte-level BPE `tokenizer.json`: `regular[i]` is id i, `merges` in priority order,
    the special tokens as added tokens, `pattern` as an isolating Split pre-tokeniser."""
    spell = bytelevel.to_chars
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False,
                  "vocab": {spell(tok): i for i, tok in enumerate(regular)},
                  "merges": [[spell(a), spell(b)] for a, b in merges]},
    }
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
