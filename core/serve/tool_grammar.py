"""tool_choice "required" / named function on K3 chat: the answer is one constrained tool call;
tool_choice "auto" with `strict: true` tools: free text, but a tool call, once the model opens
the tools channel, is one constrained call.

The K3 tools channel is XTML (k3-architecture.md section 5): after an empty response channel,

    <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>

The markers are forced tokens; the tool name is a choice among the declared tools (named:
forced) whose outcome picks that tool's arguments; each declared property of its JSON-schema
parameters becomes one argument, in declaration order, whose value is constrained by the
property's schema: compact JSON for typed values, raw text for strings (its enum, its pattern,
or up to maxLength characters (default 64) without "<" or control characters, so a value
cannot spell a marker). This is a segment program (`k3.structured.program`), not an xgrammar
structural tag.

Under "auto" (`auto_call_spec`) the same call program starts only when the output ends with the
tools channel's opening marker (the spec's trigger): the answer before it, thinking and response
text alike, is free, and an answer that never opens the tools channel is unconstrained. After
the marker the call is constrained as above (one call; the markers that close it are forced).
"""

from __future__ import annotations

from k3.chat.xtml import (ARGUMENT_CLOSE, CALL_CLOSE, END_OF_MSG, MESSAGE_CLOSE, OPEN, RESPONSE_CLOSE,
                          RESPONSE_OPEN, SEP, THINK_CLOSE, TOOLS_CLOSE, TOOLS_OPEN, escape_attr)
from k3.structured import StructuredOutputsParams
from k3.structured.program import Constrained, Forced

DEFAULT_MAX_STRING = 64
XTML_TYPES = {"string", "number", "boolean", "null", "object", "array"}


def _value_spec(schema: dict) -> tuple[str, StructuredOutputsParams]:
    """(the argument's type attribute, the spec of its value) for one property schema."""
    kind = schema.get("type")
    if kind == "string":
        if schema.get("enum"):
            return "string", StructuredOutputsParams(choice=[str(v) for v in schema["enum"]])
        if schema.get("pattern"):
            return "string", StructuredOutputsParams(regex=schema["pattern"].removeprefix("^").removesuffix("$"))
        low, high = int(schema.get("minLength", 0)), int(schema.get("maxLength", DEFAULT_MAX_STRING))
        return "string", StructuredOutputsParams(regex=f"[^<\\x00-\\x1f]{{{low},{high}}}")
    label = "number" if kind == "integer" else kind if kind in XTML_TYPES else "object"
    return label, StructuredOutputsParams(json=schema)


def _arguments(tokenizer, tool: dict) -> list:
    enc = _encoder(tokenizer)
    out = []
    for key, schema in ((tool.get("parameters") or {}).get("properties") or {}).items():
        label, spec = _value_spec(schema if isinstance(schema, dict) else {})
        out += [Forced(enc(f'{OPEN}argument key="{escape_attr(key)}" type="{label}"{SEP}')), Constrained(spec),
                Forced(enc(ARGUMENT_CLOSE))]
    return out


def _encoder(tokenizer):
    return lambda text: tuple(tokenizer.encode(text, allow_special=True))


CALL_HEAD_END = '" index="1"' + SEP                 # after the tool name in the call's opening marker


def _call_tail(enc) -> Forced:
    """The markers that close the one call, the tools channel and the message."""
    return Forced(enc(CALL_CLOSE + TOOLS_CLOSE + MESSAGE_CLOSE + END_OF_MSG))


def _any_declared_call(tokenizer, tools: list[dict]) -> Constrained:
    """A choice among the declared tools' names; each branch is the rest of that tool's call
    (the marker's end, its arguments, the closing markers)."""
    enc = _encoder(tokenizer)
    by_name = {t["name"]: t for t in tools}                       # a repeated name: its last declaration
    branches = tuple((escape_attr(n), (Forced(enc(CALL_HEAD_END)), *_arguments(tokenizer, t), _call_tail(enc)))
                     for n, t in by_name.items())
    return Constrained(StructuredOutputsParams(choice=[escape_attr(n) for n in by_name]), branches=branches)


def tool_call_spec(tokenizer, tools: list[dict], tool_choice, *, thinking: bool) -> StructuredOutputsParams:
    """The constraint of a K3 answer under tool_choice "required" or a named function.
    tools: the request's function specs ({"name", "parameters", ...})."""
    enc = _encoder(tokenizer)
    head = (RESPONSE_OPEN if thinking else "") + RESPONSE_CLOSE + TOOLS_OPEN + OPEN + 'call tool="'
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = {t["name"]: t for t in tools}[name]        # a repeated name: its last declaration
        program = [Forced(enc(head + escape_attr(name) + CALL_HEAD_END)), *_arguments(tokenizer, tool),
                   _call_tail(enc)]
    else:
        program = [Forced(enc(head)), _any_declared_call(tokenizer, tools)]
    return StructuredOutputsParams(sequence=tuple(program), trigger=enc(THINK_CLOSE) if thinking else ())


def auto_call_spec(tokenizer, tools: list[dict]) -> StructuredOutputsParams:
    """The constraint of a K3 answer under tool_choice "auto" with strict tools: free until the
    tools channel opens (the trigger), then one call of a declared tool with schema-constrained
    arguments and forced closing markers."""
    enc = _encoder(tokenizer)
    program = [Forced(enc(OPEN + 'call tool="')), _any_declared_call(tokenizer, tools)]
    return StructuredOutputsParams(sequence=tuple(program), trigger=enc(TOOLS_OPEN))


__all__ = ["auto_call_spec", "tool_call_spec"]
