"""Structured outputs: grammars that constrain what a request may generate (issue 29).

`StructuredOutputsParams` says what the output must match (a JSON schema, any JSON object, a
regex, one of several strings, an EBNF grammar); a `GrammarBackend` (`k3.structured.backend`,
xgrammar by default) compiles it against the tokenizer's vocabulary; `StructuredOutputs`
(`k3.structured.manager`) caches compiled grammars, compiles off the caller's loop with a time
limit, and hands each request a `RequestGrammar` (`k3.structured.request_state`) that fills
its row of a packed token bitmask and follows the tokens the request accepts.
"""

from .bitmask import bitmask_width, unpack_bitmask
from .errors import StructuredOutputError
from .manager import StructuredOutputs
from .request_state import RequestGrammar
from .spec import StructuredOutputsParams

__all__ = ["RequestGrammar", "StructuredOutputError", "StructuredOutputs", "StructuredOutputsParams",
           "bitmask_width", "unpack_bitmask"]
