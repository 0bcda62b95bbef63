"""The K3 XTML chat renderer (k3-architecture.md section 5).

Order: global options (``tool-declare``, then ``thinking-effort`` in thinking mode), the
conversation, one-shot options (``tool-choice``, ``response-format``), then the generation prefix
that opens the assistant message on ``think`` (thinking) or ``response`` (instruct).

Assistant history keeps the ``think`` channel in thinking mode (empty when the message has no
reasoning) and drops it in instruct mode. Tool results are matched to the calls of the preceding
assistant message and rendered in call order as ``role="tool" tool="NAME" index="I"``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from k3.chat.errors import ChatTemplateError
from k3.chat.media import IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, user_parts
from k3.chat.messages import (
    Call, ToolResultMatcher, calls_of, compact_json, deep_sorted, optional_str, role_of, text_of,
    tool_name, tool_specs,
)
from k3.chat.segments import Segment, SegmentWriter
from k3.chat.xtml import CLOSE, END_OF_MSG, OPEN, SEP, escape_attr

THINKING_EFFORTS = ("low", "medium", "high", "max")
DEFAULT_THINKING_EFFORT = "max"

# Bodies of the system messages the renderer writes itself. TOOL_DECLARE_HEADER, the sentences
# "The system is invoked with `X=Y`." and "You MUST call tools in the next message." are the
# documented K3 wording (k3-architecture.md section 5); the remaining sentences are ours (the
# trained wording is not in our sources), kept here so they can be swapped in one place.
TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
THINKING_EFFORT_BODY = (
    "`thinking_effort` sets how long you think in the think channel before you respond (the "
    "response channel does not count); it takes the values `low`, `medium`, `high` and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_CHOICE_REQUIRED = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
TOOL_CHOICE_NAMED = (
    "The system is invoked with `tool_choice=required`.\nYou MUST call the tool `{name}` in the next message."
)
TOOL_CHOICE_NONE = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call tools in the next message."
RESPONSE_JSON_OBJECT = (
    "The system is invoked with `response_format=json_object`.\n"
    "Reply with one raw JSON value only: no markdown code fence and no text around it."
)
RESPONSE_JSON_SCHEMA = (
    "The system is invoked with `response_format=json_schema`.\n"
    "Reply with one raw JSON value only: no markdown code fence and no text around it."
    " It must validate against this JSON Schema:\n```json\n{schema}\n```"
)


def render_k3_chat(messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
    """The K3 prompt as text, special tokens as their literal strings.

    ``render_k3_chat(messages, *, tools=None, thinking=True, thinking_effort=None,
    tool_choice=None, response_format=None, add_generation_prompt=True)``; see
    :func:`render_k3_segments` for the options. Raises ChatTemplateError on invalid input.
    """
    return "".join(s.text for s in render_k3_segments(messages, **options))


def render_k3_segments(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The K3 prompt as :class:`Segment` s (see :mod:`k3.chat.segments` for why).

    ``messages``: OpenAI-style system/developer/user/assistant/tool messages; content a string or
    text parts (user messages also ``image_url`` parts, rendered as k3.chat.media says); assistant ``reasoning_content`` (or ``reasoning``) and ``tool_calls`` (arguments a
    JSON object string); tool messages ``tool_call_id`` and/or ``name``; a system message may carry
    ``tools`` to declare more tools at that point. ``tools``: OpenAI tool specs, declared in
    compact deep-key-sorted JSON. ``thinking``: thinking mode (else instruct). ``thinking_effort``:
    low/medium/high/max, default max, thinking mode only. ``tool_choice``: None/"auto", "none",
    "required" or ``{"type": "function", "function": {"name": N}}``. ``response_format``: None,
    ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": {...}}}``.
    """
    w = _Writer()
    specs = tool_specs(tools)
    declared = {tool_name(s) for s in specs}
    if specs:
        w.system("tool-declare", _declare_body(specs))
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ChatTemplateError(
            f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)}, not {thinking_effort!r}")
    if thinking:
        w.system("thinking-effort", THINKING_EFFORT_BODY.format(effort=thinking_effort or DEFAULT_THINKING_EFFORT))

    matcher = ToolResultMatcher()
    i = 0
    while i < len(messages):
        where = f"messages[{i}]"
        role = role_of(messages[i], where)
        msg = messages[i]
        if role == "tool":
            run = []
            while i < len(messages) and role_of(messages[i], f"messages[{i}]") == "tool":
                run.append((matcher.match(messages[i], f"messages[{i}]"), i))
                i += 1
            for pos, j in sorted(run):
                call = matcher.calls[pos]
                w.open("message", {"role": "tool", "tool": call.name, "index": pos + 1})
                w.text(text_of(messages[j].get("content"), f"messages[{j}]"))
                w.end_message()
            continue
        if role == "assistant":
            calls = calls_of(msg, where)
            matcher.start_turn(calls)
            _assistant(w, msg, calls, thinking, where)
        elif role == "user" or not msg.get("tools"):
            _plain(w, "user" if role == "user" else "system", msg, where)
        else:  # a system message that declares more tools
            more = tool_specs(msg["tools"], f"{where}.tools")
            declared |= {tool_name(s) for s in more}
            w.system("tool-declare", _declare_body(more))
            if text_of(msg.get("content"), where):
                _plain(w, "system", msg, where)
        i += 1

    _one_shot_options(w, tool_choice, response_format, declared)
    if add_generation_prompt:
        w.open("message", {"role": "assistant"})
        w.open("think" if thinking else "response")
    return w.segments


def _declare_body(specs: list) -> str:
    return f"{TOOL_DECLARE_HEADER}```json\n{compact_json(deep_sorted(specs))}\n```"


def _plain(w: "_Writer", role: str, msg: Mapping, where: str) -> None:
    attrs = {"role": role}
    if name := optional_str(msg, "name", where):
        attrs["name"] = name
    w.open("message", attrs)
    if role == "user":
        for kind, value in user_parts(msg.get("content"), where):
            if kind == "text":
                w.text(value)
            else:          # an image: one placeholder between the media markers (k3.chat.media)
                w.special(MEDIA_BEGIN)
                w.text("image")
                w.special(MEDIA_CONTENT)
                w.special(IMAGE_PLACEHOLDER)
                w.special(MEDIA_END)
    else:
        w.text(text_of(msg.get("content"), where))
    w.end_message()


def _assistant(w: "_Writer", msg: Mapping, calls: list[Call], thinking: bool, where: str) -> None:
    attrs = {"role": "assistant"}
    if name := optional_str(msg, "name", where):
        attrs["name"] = name
    w.open("message", attrs)
    if thinking:
        reasoning = optional_str(msg, "reasoning_content", where) or optional_str(msg, "reasoning", where)
        w.element("think", reasoning or "")
    w.element("response", text_of(msg.get("content"), where))
    if calls:
        w.open("tools")
        for index, call in enumerate(calls, start=1):
            w.open("call", {"tool": call.name, "index": index})
            for key, value in call.arguments.items():
                kind, body = _typed(value, f"{where}.tool_calls[{index - 1}] argument {key!r}")
                w.open("argument", {"key": key, "type": kind})
                w.text(body)
                w.close("argument")
            w.close("call")
        w.close("tools")
    w.end_message()


def _typed(value: Any, where: str) -> tuple[str, str]:
    """XTML ``type`` and body of an argument value: strings raw, everything else compact JSON."""
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):
        kind = "boolean"
    elif value is None:
        kind = "null"
    elif isinstance(value, (int, float)):
        kind = "number"
    elif isinstance(value, Mapping):
        kind = "object"
    elif isinstance(value, (list, tuple)):
        kind = "array"
    else:
        raise ChatTemplateError(f"{where} has a value of type {type(value).__name__} that JSON cannot hold")
    return kind, compact_json(value)


def _one_shot_options(w: "_Writer", tool_choice: Any, response_format: Any, declared: set) -> None:
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if name not in declared:
            raise ChatTemplateError(f"tool_choice names function {name!r}, which is not among the declared tools")
        w.system("tool-choice", TOOL_CHOICE_NAMED.format(name=name))
    elif tool_choice == "required":
        if not declared:
            raise ChatTemplateError("tool_choice='required' needs at least one tool")
        w.system("tool-choice", TOOL_CHOICE_REQUIRED)
    elif tool_choice == "none":
        if declared:
            w.system("tool-choice", TOOL_CHOICE_NONE)
    elif tool_choice not in (None, "auto"):
        raise ChatTemplateError(
            f"tool_choice must be 'auto', 'none', 'required' or a named function, not {tool_choice!r}")

    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    if kind == "json_object":
        w.system("response-format", RESPONSE_JSON_OBJECT)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ChatTemplateError("response_format json_schema needs json_schema.schema (an object)")
        w.system("response-format", RESPONSE_JSON_SCHEMA.format(schema=compact_json(deep_sorted(schema))))
    elif kind not in (None, "text"):
        raise ChatTemplateError(f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")


class _Writer(SegmentWriter):
    """XTML on top of segments: one segment per special token, tag name, attribute fragment."""

    def open(self, tag: str, attrs: Mapping[str, object] | None = None) -> None:
        self.special(OPEN)
        self.text(tag)
        for key, value in (attrs or {}).items():
            self.text(f" {key}")
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.special(SEP)

    def close(self, tag: str) -> None:
        self.special(CLOSE)
        self.text(tag)
        self.special(SEP)

    def element(self, tag: str, body: str) -> None:
        self.open(tag)
        self.text(body)
        self.close(tag)

    def end_message(self) -> None:
        self.close("message")
        self.special(END_OF_MSG)

    def system(self, kind: str, body: str) -> None:
        self.open("message", {"role": "system", "type": kind})
        self.text(body)
        self.end_message()
