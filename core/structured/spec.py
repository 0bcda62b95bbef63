"""StructuredOutputsParams: what a request's output must match, in vLLM's shape.

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` is set. `json` is a JSON
schema (a dict or its JSON text); `json_object` any JSON object; `regex` a regular
expression the whole output matches; `choice` a list of strings, one of which is the output;
`grammar` an EBNF (GBNF) grammar with a `root` rule; `sequence` a segment program
(`k3.structured.program`: forced token runs and grammars, e.g. a K3 tool call).

`prefix` / `suffix` are token ids forced before / after the constrained text, and `trigger`
token ids that start the constraint only once the output ends with them (a chat wrapper:
K3's thinking mode constrains the response channel after `<|close|>think<|sep|>`). The
server builds them; offline callers usually leave them empty.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

from .errors import StructuredOutputError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "sequence")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    sequence: tuple | None = None
    whitespace_pattern: str | None = None       # accepted for vLLM parity; compact separators are used
    prefix: tuple[int, ...] = field(default=(), compare=True)
    suffix: tuple[int, ...] = field(default=(), compare=True)
    trigger: tuple[int, ...] = field(default=(), compare=True)

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_kinds) != 1:
            raise StructuredOutputError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {set_kinds or 'none'}")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError("json must be a JSON schema (an object or its JSON text)")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _json.loads(self.json))
            except ValueError as e:
                raise StructuredOutputError(f"json is not valid JSON: {e}") from None
            if not isinstance(self.json, (dict, bool)):
                raise StructuredOutputError("json must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise StructuredOutputError(f"{name} must be a non-empty string")
        for name in ("prefix", "suffix", "trigger"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """The compile-cache key: the kind and a canonical text of the constraint (the forced
        tokens are not part of the compiled grammar)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "sequence":
            return self.kind, repr(value)
        return self.kind, _json.dumps(value, sort_keys=True, separators=(",", ":"))
