"""The grammar backend interface: what k3 needs from xgrammar, llguidance or outlines-core.

A backend is built once per vocabulary (`VocabInfo`: each id's bytes, b"" for special and
padding ids, which no grammar may emit, and the stop ids a finished grammar allows). It
compiles a `StructuredOutputsParams` into an opaque compiled grammar (raising
`StructuredOutputError` for a spec it cannot compile) and makes per-request matchers from it.
A matcher follows the tokens of one request and fills that request's row of a packed int32
bitmask (`k3.structured.bitmask`). Backends register by name (`register_backend`); xgrammar is
the default, llguidance ("guidance", vLLM's name) the second; each is imported only when a
request first needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import StructuredOutputError
from .spec import StructuredOutputsParams


@dataclass(frozen=True)
class VocabInfo:
    """encoded_vocab[i]: the bytes of id i (b"": never allowed by a grammar); stop_token_ids:
    the ids that end a generation, allowed where the grammar may end."""

    encoded_vocab: tuple[bytes, ...]
    stop_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.encoded_vocab)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids) -> "VocabInfo":
        """Every regular id's bytes from a k3 tokenizer; special ids (reserved and unused slots
        included) and ids from the tokenizer's size up to the logits' `vocab_size` get b""."""
        vocab = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        vocab += [b""] * (vocab_size - len(vocab))
        return cls(tuple(vocab[:vocab_size]), tuple(int(t) for t in stop_token_ids))


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask [B, W]."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted: nothing more may follow."""


def fill_bitmasks(matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Row rows[i] of the int32 CPU bitmask [B, W] from matchers[i], for a whole step at once.
    A matcher type may define `fill_many(matchers, bitmask, rows)` (a classmethod filling many
    rows in one call, e.g. on the backend's own threads); matchers of types without it fill
    their rows one by one."""
    groups: dict[type, tuple[list, list]] = {}
    for matcher, row in zip(matchers, rows, strict=True):
        members, member_rows = groups.setdefault(type(matcher), ([], []))
        members.append(matcher)
        member_rows.append(row)
    for kind, (members, member_rows) in groups.items():
        fill_many = getattr(kind, "fill_many", None)
        if fill_many is not None:
            fill_many(members, bitmask, member_rows)
        else:
            for matcher, row in zip(members, member_rows):
                matcher.fill_bitmask(bitmask, row)


class GrammarBackend(Protocol):
    """Compiles specs for one vocabulary and makes matchers."""

    name: str

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`; StructuredOutputError when it cannot be compiled."""

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""


_BACKENDS: dict[str, str | Callable[[VocabInfo], GrammarBackend]] = {
    "xgrammar": "k3.structured.xgrammar_backend:XGrammarBackend",
    "auto": "k3.structured.xgrammar_backend:XGrammarBackend",                # vLLM's default: xgrammar here
    "guidance": "k3.structured.llguidance_backend:LLGuidanceBackend",       # vLLM's name for llguidance
    "llguidance": "k3.structured.llguidance_backend:LLGuidanceBackend",
}


def register_backend(name: str, factory: Callable[[VocabInfo], GrammarBackend]) -> None:
    """Make `factory(vocab)` the backend called `name` (llguidance, outlines-core, a test double)."""
    _BACKENDS[name] = factory


def make_backend(name: str, vocab: VocabInfo) -> GrammarBackend:
    """The backend `name` for `vocab`; StructuredOutputError when unknown or not installed."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise StructuredOutputError(f"unknown structured-output backend {name!r}; known: {sorted(_BACKENDS)}")
    if isinstance(factory, str):
        module, attr = factory.split(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise StructuredOutputError(f"the structured-output backend {name!r} is not installed ({e}); "
                                        "install k3[structured]") from None
    return factory(vocab)
