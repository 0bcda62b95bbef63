"""The xgrammar backend (the default; `pip install k3[structured]`).

xgrammar's JSON strings admit raw control characters (U+0000-U+001F other than CR and LF),
which JSON forbids unescaped; and with compact separators no JSON output has a control byte
outside a string either. So a JSON constraint's matcher also clears every token holding a
byte below 0x20 (`_json_safe`, one precomputed bitmask row).

JSON is compiled with compact separators (`{"a":1}`) and no free whitespace, so a schema
whose strings and arrays are bounded has a bounded output: a model cannot stall in an endless
run of spaces. Compiled grammars are cached by the manager, not here (xgrammar's own cache is
off so that the manager's bound is the only one).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import xgrammar as xgr

# One xgrammar batch filler per process, shared by every engine: its threads fill the rows of
# a step in parallel (xgrammar releases the GIL), so a batch's fill costs about one row's
# time per thread instead of one row's time per request.
_BATCH_THREADS = max(1, min(8, os.cpu_count() or 1))
_batch: xgr.BatchGrammarMatcher | None = None
_batch_lock = threading.Lock()


def _batch_matcher() -> xgr.BatchGrammarMatcher:
    global _batch
    with _batch_lock:
        if _batch is None:
            _batch = xgr.BatchGrammarMatcher(max_threads=_BATCH_THREADS)
        return _batch

from .backend import VocabInfo
from .errors import StructuredOutputError, first_line
from .spec import StructuredOutputsParams


class XGrammarMatcher:
    def __init__(self, compiled: Any, keep: torch.Tensor | None = None, cleared: frozenset[int] = frozenset()):
        self._m = xgr.GrammarMatcher(compiled)
        self._keep = keep            # int32 [W]: a bitmask row ANDed in (JSON: no control bytes)
        self._cleared = cleared      # the ids `keep` clears

    def accept_token(self, token_id: int) -> bool:
        """As xgrammar's, and False for a token the keep mask clears (the bitmask never allows
        it either: a drafted token is checked by this)."""
        t = int(token_id)
        return t not in self._cleared and bool(self._m.accept_token(t))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._keep is not None:
            bitmask[row] &= self._keep

    @classmethod
    def fill_many(cls, matchers: list["XGrammarMatcher"], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows `rows` of `bitmask` from `matchers` in one call on xgrammar's threads, then each
        JSON row ANDed with its keep mask (one op for all rows that share a mask)."""
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        # one matcher named for several rows is filled once and its row copied: xgrammar's threads
        # filling one matcher at once race on its state (an intermittent wrong row or "bad optional
        # access" in tests/unit/structured's batch test)
        first: dict[int, int] = {}                        # id(matcher) -> the row it fills
        unique, unique_rows, copies = [], [], []
        for m, row in zip(matchers, rows):
            if id(m) in first:
                copies.append((first[id(m)], row))
            else:
                first[id(m)] = row
                unique.append(m)
                unique_rows.append(row)
        _batch_matcher().batch_fill_next_token_bitmask([m._m for m in unique], bitmask, unique_rows)
        for src, dst in copies:
            bitmask[dst] = bitmask[src]
        by_keep: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for m, row in zip(matchers, rows):
            if m._keep is not None:
                by_keep.setdefault(id(m._keep), (m._keep, []))[1].append(row)
        for keep, keep_rows in by_keep.values():
            index = torch.tensor(keep_rows)
            bitmask[index] = bitmask[index] & keep

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, vocab: VocabInfo, *, max_threads: int = 2):
        self.vocab = vocab
        info = xgr.TokenizerInfo(list(vocab.encoded_vocab), xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._json_safe = _json_safe(vocab)
        stops = set(vocab.stop_token_ids)
        self._json_cleared = frozenset(i for i, raw in enumerate(vocab.encoded_vocab)
                                       if i not in stops and any(b < 0x20 for b in raw))

    def compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        try:
            if spec.json is not None:
                return _Json(c.compile_json_schema(spec.json, any_whitespace=False, separators=(",", ":")))
            if spec.json_object:
                return _Json(c.compile_json_schema({"type": "object"}, any_whitespace=False, separators=(",", ":")))
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                body = " | ".join(_ebnf_string(s) for s in spec.choice)
                return c.compile_grammar(f"root ::= {body}")
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar's parse and schema errors
            raise StructuredOutputError(f"the {spec.kind} constraint cannot be compiled: {first_line(e)}",
                                        field=spec.kind) from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        if isinstance(compiled, _Json):
            return XGrammarMatcher(compiled.grammar, self._json_safe, self._json_cleared)
        return XGrammarMatcher(compiled)


class _Json:
    """A compiled JSON grammar (its matchers also clear control-byte tokens)."""

    def __init__(self, grammar: Any):
        self.grammar = grammar


def _json_safe(vocab: VocabInfo) -> torch.Tensor:
    """int32 bitmask row: 1 for every token without a byte below 0x20 (stop ids kept)."""
    words = [0] * ((vocab.vocab_size + 31) // 32)
    stops = set(vocab.stop_token_ids)
    for i, raw in enumerate(vocab.encoded_vocab):
        if i in stops or not any(b < 0x20 for b in raw):
            words[i // 32] |= 1 << (i % 32)
    return torch.tensor([((w + (1 << 31)) % (1 << 32)) - (1 << 31) for w in words], dtype=torch.int32)


def _ebnf_string(text: str) -> str:
    """An EBNF string literal for `text` (JSON escaping is a valid GBNF literal)."""
    import json

    return json.dumps(text, ensure_ascii=False)

