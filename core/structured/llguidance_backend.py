"""The llguidance backend (`--structured-outputs-config '{"backend": "guidance"}'`, vLLM's
name for it; "llguidance" is accepted too; `pip install k3[structured]`).

llguidance builds its token trie from each id's bytes, as xgrammar does; ids with no bytes
(special and unused) get llguidance's special-token spelling (0xFF then a name), so no grammar
text can reach them. JSON is compiled compact (`,` and `:`, no free whitespace), as with
xgrammar, so a bounded schema has a bounded output.

Two differences from xgrammar's matcher are absorbed here so that `GrammarMatcher` means the
same for both: a refused token must leave the matcher usable (llguidance's `consume_token`
would put it in a permanent error state, so tokens go through `try_consume_tokens`), and a stop
id is "accepted" even when the grammar is already complete (llguidance then consumes it without
a history entry, so `rollback` counts only the tokens llguidance recorded).

A spec compiles once into a template matcher (the grammar's lexer and parser are built then, off
the engine loop); each request's matcher is a `deep_copy` of it.
"""

from __future__ import annotations

import os
from typing import Any

import llguidance as llg
import llguidance.torch as llg_torch
import torch

from .backend import VocabInfo
from .errors import StructuredOutputError, first_line
from .spec import StructuredOutputsParams

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_executor: llg.LLExecutor | None = None


def _shared_executor() -> llg.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
    return _executor


class _BytesTokenizer:
    """What llguidance's TokenizerWrapper reads: the vocabulary as bytes, the special ids, and
    a tokenize function (greedy longest match over the vocabulary: llguidance uses it only to
    spell forced text, never for masks)."""

    def __init__(self, vocab: VocabInfo):
        self.eos_token_id = vocab.stop_token_ids[0] if vocab.stop_token_ids else 0
        self.bos_token_id = None
        self.tokens = [raw if raw else b"\xff<|k3_special_%d|>" % i for i, raw in enumerate(vocab.encoded_vocab)]
        self.special_token_ids = [i for i, raw in enumerate(vocab.encoded_vocab) if not raw]
        self._ids = {raw: i for i, raw in enumerate(vocab.encoded_vocab) if raw}
        self._longest = max((len(raw) for raw in self._ids), default=1)

    def __call__(self, data: bytes | str) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i:i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} has no token")
        return out


class LLGuidanceMatcher:
    def __init__(self, matcher: llg.LLMatcher, stop_ids: frozenset[int]):
        self._m, self._stop_ids = matcher, stop_ids
        self._recorded: list[bool] = []     # per accepted token: whether llguidance kept it in its history
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        if t in self._stop_ids and self._m.is_stopped() and not self._terminated:
            self._recorded.append(False)      # the grammar is complete: only a stop may follow, not recorded
        elif self._m.try_consume_tokens([t]) == 1:
            self._recorded.append(True)
        else:
            return False
        self._terminated = t in self._stop_ids
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llg_torch.fill_next_token_bitmask(self._m, bitmask, row)

    @classmethod
    def fill_many(cls, matchers: list["LLGuidanceMatcher"], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows `rows` of `bitmask` from `matchers` in one call on llguidance's threads."""
        llg_torch.fill_next_token_bitmask_par(_shared_executor(), [(m._m, row) for m, row in zip(matchers, rows)],
                                              bitmask)

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        undone = self._recorded[-num_tokens:]
        del self._recorded[-num_tokens:]
        if sum(undone):
            self._m.rollback(sum(undone))
        self._terminated = False                  # a stop id is always the last token accepted

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, vocab: VocabInfo):
        self.vocab = vocab
        self._tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_BytesTokenizer(vocab)), n_vocab=vocab.vocab_size,
                                          eos_token=list(vocab.stop_token_ids) or None)
        self._stop_ids = frozenset(vocab.stop_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        try:
            if spec.json is not None or spec.json_object:
                schema = spec.json if spec.json is not None else {"type": "object"}
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            elif spec.regex is not None:
                grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
            elif spec.choice is not None:
                grammar = llg.grammar_from("choice", spec.choice)
            else:
                grammar = llg.grammar_from("gbnf", spec.grammar)
        except ValueError as e:
            raise StructuredOutputError(f"the {spec.kind} constraint cannot be compiled: {first_line(e)}",
                                        field=spec.kind) from None
        template = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise StructuredOutputError(f"the {spec.kind} constraint cannot be compiled: "
                                        f"{first_line(template.get_error())}", field=spec.kind)
        return template

    def matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._stop_ids)

