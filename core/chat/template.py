"""Chat prompt token ids for a tokenizer: the model's format (K3 XTML or K2-style), encoded
segment by segment so that marker text inside messages stays text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k3.tokenizer import specials

from .errors import ChatFormatUnavailable, ChatTemplateError
from .render_k2 import render_k2_segments
from .render_k3 import render_k3_segments
from .segments import encode_segments


def thinking_from_kwargs(kwargs: Mapping[str, Any]) -> bool:
    """`chat_template_kwargs` thinking switch: `thinking` or `enable_thinking` (default on)."""
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ChatTemplateError(f"chat_template_kwargs.{key} must be true or false")
            return kwargs[key]
    return True


def chat_format(tokenizer) -> str:
    """The chat format k3 renders for this tokenizer: "k3" (XTML) or "k2" (<|im_*|>).

    ChatFormatUnavailable when the tokenizer's end-of-message token names no format (then both
    are looked for) or when it lacks a marker of the format it names; the message says which
    format(s) were looked for and which marker tokens are absent."""
    missing = tokenizer.missing_chat_markers()
    flavor = tokenizer.flavor
    if flavor is not None and not missing[flavor]:
        return flavor
    looked = " and ".join(
        f"{specials.CHAT_FORMAT_NAMES[f]} (needs {', '.join(specials.CHAT_MARKERS[f])}; "
        + ("all absent)" if len(absent) == len(specials.CHAT_MARKERS[f]) else f"absent: {', '.join(absent)})")
        for f, absent in missing.items())
    problem = "has no chat format" if flavor is None else "lacks chat markers"
    message = f"this model's tokenizer {problem}: looked for {looked}"
    raise ChatFormatUnavailable(message, missing)


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], *, tools=None, tool_choice=None,
                    response_format=None, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat format (`chat_format`).

    template_kwargs: `thinking` / `enable_thinking` (bool) and `thinking_effort` for K3; others
    are refused with a ChatTemplateError naming them. ChatFormatUnavailable (see `chat_format`)
    for a tokenizer without chat markers.
    """
    flavor = chat_format(tokenizer)
    known = {"thinking", "enable_thinking", "thinking_effort"}
    unknown = sorted(set(template_kwargs) - known)
    if unknown:
        raise ChatTemplateError(f"unknown chat_template_kwargs: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if flavor == "k3":
        segments = render_k3_segments(messages, tools=tools, thinking=thinking_from_kwargs(template_kwargs),
                                      thinking_effort=template_kwargs.get("thinking_effort"),
                                      tool_choice=tool_choice, response_format=response_format,
                                      add_generation_prompt=add_generation_prompt)
    else:
        segments = render_k2_segments(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return encode_segments(tokenizer, segments)
