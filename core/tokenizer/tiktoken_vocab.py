"""Source (a): a tiktoken-style vocabulary, as Moonshot's Kimi checkpoints ship it.

- `tiktoken.model`: one regular token a line, `base64(token bytes) rank`; ranks are the ids
  0 .. N-1 and the merge priority.
- `tokenizer_config.json`: `added_tokens_decoder` maps ids (as strings) to
  `{"content": name, ...}`. Special ids start at N; a slot from N up to the highest listed id
  that the file does not name is `<|reserved_token_ID|>`, as Kimi's own tokenizer names it.

The `tiktoken` package does the BPE (locally, from the parsed ranks) with the pre-tokenisation
of `pretokenize.PATTERN`; special tokens are split out by `Tokenizer.encode`.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import tiktoken

from k3.tokenizer import specials
from k3.tokenizer.byte_bpe import ByteLevelTokenizer
from k3.tokenizer.pretokenize import PATTERN

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


class TiktokenTokenizer(ByteLevelTokenizer):
    """BPE over `regular` (the bytes of ids 0..N-1, in rank order) through `tiktoken`, with the
    special tokens `special_tokens` (ids N and above, dense up to the last one); roles and
    eos_fallback as `Tokenizer` takes them."""

    def __init__(self, regular: Sequence[bytes], special_tokens: Mapping[str, int], *, source: str,
                 pattern: str = PATTERN, roles: Mapping[str, str] | None = None, eos_fallback: Iterable[int] = ()):
        n = len(regular)
        by_id = {i: name for name, i in special_tokens.items()}
        if by_id and (min(by_id) != n or max(by_id) != n + len(by_id) - 1):
            raise ValueError(f"{source}: special ids must run densely from {n}, "
                             f"got {min(by_id)}..{max(by_id)} for {len(by_id)} tokens")
        table = list(regular) + [by_id[i].encode("utf-8") for i in range(n, n + len(by_id))]
        super().__init__(token_bytes=table, special_tokens=special_tokens, source=source, roles=roles,
                         eos_fallback=eos_fallback)
        self._enc = tiktoken.Encoding(f"k3:{source}", pat_str=pattern,
                                      mergeable_ranks={b: i for i, b in enumerate(regular)},
                                      special_tokens={})
        self.regular_tokens: tuple[bytes, ...] = tuple(regular)
        """Bytes of the regular tokens, in rank (= id) order."""

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)


def read_tiktoken_model(path: Path) -> list[bytes]:
    """The regular tokens of a `tiktoken.model` file, indexed by rank. Errors name the file and
    the line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such vocabulary file") from None
    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}:{lineno}: malformed token or rank in {line[:80]!r}") from None
        if not token:
            raise ValueError(f"{path}:{lineno}: empty token")
        if rank in by_rank:
            raise ValueError(f"{path}:{lineno}: rank {rank} appears twice")
        if token in seen:
            raise ValueError(f"{path}:{lineno}: token {token!r} appears twice (first at rank {seen[token]})")
        by_rank[rank] = token
        seen[token] = rank
    if not by_rank:
        raise ValueError(f"{path}: no tokens")
    n = len(by_rank)
    if min(by_rank) != 0 or max(by_rank) != n - 1:
        missing = next(r for r in range(n) if r not in by_rank)
        raise ValueError(f"{path}: ranks must be 0..{n - 1} without gaps; rank {missing} is missing")
    return [by_rank[r] for r in range(n)]


def read_added_tokens(path: Path, first_special: int) -> dict[str, int]:
    """Special-token table from a `tokenizer_config.json`: its `added_tokens_decoder`, with
    unnamed slots between `first_special` and the highest listed id filled as reserved. A
    config without one (or with an empty one) gives no special tokens."""
    config = read_json(path)
    added = config.get("added_tokens_decoder")
    if added is None or added == {}:
        return {}
    if not isinstance(added, dict):
        raise ValueError(f"{path}: 'added_tokens_decoder' must map ids to tokens, got {type(added).__name__}")
    names: dict[int, str] = {}
    for key, entry in added.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(content, str) or not content:
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] needs an integer key and a 'content' string")
        i = int(key)
        if i < first_special:
            raise ValueError(f"{path}: added token {content!r} has id {i}, inside the regular "
                             f"vocabulary (0..{first_special - 1}) of {path.parent / TIKTOKEN_FILE}")
        names[i] = content
    table: dict[str, int] = {}
    for i in range(first_special, max(names) + 1):
        name = names.get(i, specials.reserved_name(i))
        if name in table:
            raise ValueError(f"{path}: special token {name!r} is listed for ids {table[name]} and {i}")
        table[name] = i
    return table


def read_json(path: Path) -> dict:
    """A JSON object from a file; errors name the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tiktoken_dir(model_dir: Path, *, roles: Mapping[str, str] | None = None,
                      eos_fallback: Iterable[int] = ()) -> TiktokenTokenizer:
    """Load `tiktoken.model` + `tokenizer_config.json` from a checkpoint directory."""
    model_path, config_path = model_dir / TIKTOKEN_FILE, model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir}: has {TIKTOKEN_FILE} but no {CONFIG_FILE} "
                                f"(its added_tokens_decoder names the special tokens)")
    regular = read_tiktoken_model(model_path)
    table = read_added_tokens(config_path, len(regular))
    return TiktokenTokenizer(regular, table, source=str(model_path), roles=roles, eos_fallback=eos_fallback)


def write_tiktoken_dir(model_dir: Path, regular: Sequence[bytes], special_tokens: Mapping[str, int],
                       *, extra_config: Mapping[str, object] = ()) -> list[Path]:
    """Write `tiktoken.model` and `tokenizer_config.json` (every special slot listed)."""
    model_path, config_path = model_dir / TIKTOKEN_FILE, model_dir / CONFIG_FILE
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(regular)]
    model_path.write_text("".join(lines), encoding="ascii")
    decoder = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1])}
    config = {"added_tokens_decoder": decoder, **dict(extra_config)}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [model_path, config_path]
