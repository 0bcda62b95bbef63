"""K3 XTML vocabulary: the marker strings, attribute escaping and tag builders.

XTML ("eXtensible Token Markup Language", k3-architecture.md section 5) wraps every element as
``<|open|>TAG[ key="val" ...]<|sep|>BODY<|close|>TAG<|sep|>``. ``<|open|>``, ``<|close|>``,
``<|sep|>`` and ``<|end_of_msg|>`` are single special tokens; the tag name and attributes between
them are ordinary text. Everything in k3.chat works on text in which the special tokens appear as
these literal strings.
"""

from __future__ import annotations

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"

#: The special tokens of the XTML structure (the tokenizer maps each to one id).
SPECIAL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)


def escape_attr(value: object) -> str:
    """An attribute value as written between quotes: ``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of :func:`escape_attr` (``&quot;`` first, then ``&amp;``, as vLLM's parser does)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, attrs: dict[str, object] | None = None) -> str:
    """``<|open|>tag key="val"...<|sep|>`` with escaped attribute values, in the given order."""
    head = "".join(f' {k}="{escape_attr(v)}"' for k, v in (attrs or {}).items())
    return f"{OPEN}{tag}{head}{SEP}"


def close_tag(tag: str) -> str:
    """``<|close|>tag<|sep|>``."""
    return f"{CLOSE}{tag}{SEP}"


# Markers the parsers and tests refer to by name.
THINK_OPEN = open_tag("think")
THINK_CLOSE = close_tag("think")
RESPONSE_OPEN = open_tag("response")
RESPONSE_CLOSE = close_tag("response")
TOOLS_OPEN = open_tag("tools")
TOOLS_CLOSE = close_tag("tools")
CALL_CLOSE = close_tag("call")
ARGUMENT_CLOSE = close_tag("argument")
MESSAGE_CLOSE = close_tag("message")

#: What the renderer appends for ``add_generation_prompt`` in each mode.
GENERATION_PREFIX_THINKING = open_tag("message", {"role": "assistant"}) + THINK_OPEN
GENERATION_PREFIX_INSTRUCT = open_tag("message", {"role": "assistant"}) + RESPONSE_OPEN
