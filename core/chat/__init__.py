"""k3.chat: chat prompts in, parsed model output out. Text only: special tokens appear as their
literal strings (``<|open|>``, ``<|im_user|>``...), the tokenizer maps them to ids.

Rendering
    render_k3_chat / render_k3_segments   K3 XTML prompt (Kimi K3, K3.1 Pro)
    render_k2_chat / render_k2_segments   K2-style ``<|im_*|>`` prompt (Kimi-Linear)
Parsing K3 output (streaming: ``feed(delta) -> events``, ``finish() -> events``; ``parse(text)``)
    K3OutputParser       reasoning + content + tool calls of one request
    K3ReasoningParser    reasoning / content split only
    K3ToolParser         content + tool calls of output without reasoning
Errors
    ChatTemplateError (a ValueError): invalid chat input; the server answers 400.
    ChatFormatUnavailable (a ChatTemplateError): the tokenizer has no chat format's markers.
"""

from k3.chat.errors import ChatFormatUnavailable, ChatTemplateError
from k3.chat.events import ContentDelta, Event, ParsedOutput, ReasoningDelta, ToolCall
from k3.chat.parse_k3 import K3OutputParser, K3ReasoningParser, K3ToolParser, is_reasoning_end, parse_k3_output
from k3.chat.render_k2 import render_k2_chat, render_k2_segments
from k3.chat.render_k3 import render_k3_chat, render_k3_segments
from k3.chat.segments import Segment, encode_segments

__all__ = [
    "ChatFormatUnavailable",
    "ChatTemplateError",
    "ContentDelta",
    "Event",
    "K3OutputParser",
    "K3ReasoningParser",
    "K3ToolParser",
    "ParsedOutput",
    "ReasoningDelta",
    "Segment",
    "encode_segments",
    "ToolCall",
    "is_reasoning_end",
    "parse_k3_output",
    "render_k2_chat",
    "render_k2_segments",
    "render_k3_chat",
    "render_k3_segments",
]
