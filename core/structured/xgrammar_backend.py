"""The xgrammar backend (the default; `pip install k3[structured]`).

JSON is compiled with compact separators (`{"a":1}`) and no free whitespace, so a schema
whose strings and arrays are bounded has a bounded output: a model cannot stall in an endless
run of spaces. Compiled grammars are cached by the manager, not here (xgrammar's own cache is
off so that the manager's bound is the only one).
"""

from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from .backend import VocabInfo
from .errors import StructuredOutputError
from .spec import StructuredOutputsParams


class XGrammarMatcher:
    def __init__(self, compiled: Any):
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

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

    def compile(self, spec: StructuredOutputsParams) -> Any:
        c = self._compiler
        try:
            if spec.json is not None:
                return c.compile_json_schema(spec.json, any_whitespace=False, separators=(",", ":"))
            if spec.json_object:
                return c.compile_json_schema({"type": "object"}, any_whitespace=False, separators=(",", ":"))
            if spec.regex is not None:
                return c.compile_regex(spec.regex)
            if spec.choice is not None:
                body = " | ".join(_ebnf_string(s) for s in spec.choice)
                return c.compile_grammar(f"root ::= {body}")
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar's parse and schema errors
            raise StructuredOutputError(f"the {spec.kind} constraint cannot be compiled: {_first_line(e)}",
                                        field=spec.kind) from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)


def _ebnf_string(text: str) -> str:
    """An EBNF string literal for `text` (JSON escaping is a valid GBNF literal)."""
    import json

    return json.dumps(text, ensure_ascii=False)


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__
