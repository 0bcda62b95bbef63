"""The Kimi-Linear chat renderer: the K2-style ``<|im_*|>`` template (k3-model-math.md 10.1).

Layout, with nothing between segments::

    <|im_system|>tool_declare<|im_middle|>[tools, compact JSON]<|im_end|>          (if tools)
    <|im_system|>system<|im_middle|>You are Kimi, ...<|im_end|>                 (if no leading system)
    <|im_user|>user<|im_middle|>TEXT<|im_end|>
    <|im_assistant|>assistant<|im_middle|>TEXT<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.NAME:IDX\\nRESULT<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                          (generation prompt)

The word after ``<|im_user|>`` / ``<|im_assistant|>`` / ``<|im_system|>`` is the message's ``name``
when it has one, else its role (``system`` for developer). Call ids already of the form
``functions.NAME:IDX`` are kept; other ids are replaced by ``functions.NAME:N`` with N counting the
calls of the conversation from 0, and the tool results that answer them follow. Reasoning is not
rendered (Kimi-Linear has no thinking mode).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from k3.chat.messages import ToolResultMatcher, calls_of, compact_json, optional_str, role_of, text_of, tool_specs
from k3.chat.segments import Segment, SegmentWriter

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

_K2_CALL_ID = re.compile(r"functions\.[^:]+:\d+")
_STARTS = {"system": IM_SYSTEM, "developer": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}


def render_k2_chat(messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
    """The Kimi-Linear prompt as text (``render_k2_chat(messages, *, tools=None,
    add_generation_prompt=True)``). Raises ChatTemplateError on invalid input."""
    return "".join(s.text for s in render_k2_segments(messages, **options))


def render_k2_segments(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """The Kimi-Linear prompt as segments (special tokens apart from text)."""
    w = SegmentWriter()
    specs = tool_specs(tools)
    if specs:
        _turn(w, IM_SYSTEM, "tool_declare", compact_json(specs))
    roles = [role_of(m, f"messages[{i}]") for i, m in enumerate(messages)]
    if not roles or roles[0] not in ("system", "developer"):
        _turn(w, IM_SYSTEM, "system", DEFAULT_SYSTEM_PROMPT)

    matcher, rendered_ids, n_calls = ToolResultMatcher(), [], 0
    for i, (msg, role) in enumerate(zip(messages, roles)):
        where = f"messages[{i}]"
        name = optional_str(msg, "name", where) or ("system" if role == "developer" else role)
        text = text_of(msg.get("content"), where)
        if role == "tool":
            call_id = rendered_ids[matcher.match(msg, where)]
            _turn(w, IM_SYSTEM, name, f"## Return of {call_id}\n{text}")
            continue
        if role != "assistant":
            _turn(w, _STARTS[role], name, text)
            continue
        calls = calls_of(msg, where)
        matcher.start_turn(calls)
        rendered_ids = []
        for call in calls:
            ok = call.id is not None and _K2_CALL_ID.fullmatch(call.id)
            rendered_ids.append(call.id if ok else f"functions.{call.name}:{n_calls}")
            n_calls += 1
        w.special(IM_ASSISTANT)
        w.text(name)
        w.special(IM_MIDDLE)
        w.text(text)
        if calls:
            w.special(SECTION_BEGIN)
            for call, call_id in zip(calls, rendered_ids):
                w.special(CALL_BEGIN)
                w.text(call_id)
                w.special(CALL_ARGS)
                w.text(call.raw)
                w.special(CALL_END)
            w.special(SECTION_END)
        w.special(IM_END)
    if add_generation_prompt:
        w.special(IM_ASSISTANT)
        w.text("assistant")
        w.special(IM_MIDDLE)
    return w.segments


def _turn(w: SegmentWriter, start: str, name: str, body: str) -> None:
    w.special(start)
    w.text(name)
    w.special(IM_MIDDLE)
    w.text(body)
    w.special(IM_END)
