"""Decode one XTML ``call`` block into a tool name and JSON arguments, or refuse it.

A well-formed call body is a sequence of ``argument`` elements separated only by whitespace::

    <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>

``type="string"`` (or no type) takes VALUE raw; any other type must be valid JSON (no NaN or
Infinity); the declared type is not checked against the JSON value, as in vLLM. A value ends at
the first ``<|close|>argument<|sep|>``; other markers inside a value are part of it, except an
``argument`` marker, which means the previous argument was never closed.

Anything else (no ``tool`` attribute, an unknown tag or text between arguments, an unclosed
argument, a missing ``key``, bad JSON in a typed argument) makes the whole call malformed; the
parser then hands its text on as content, so nothing is lost.
"""

from __future__ import annotations

import json

from k3.chat.lexer import Marker


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def decode_call(head: Marker, body: list[str | Marker]) -> tuple[str, str] | None:
    """``(name, arguments_json)`` for a well-formed call, else None (see module doc)."""
    name = head.attrs.get("tool", "")
    if not name:
        return None
    args: dict = {}
    i, n = 0, len(body)
    while i < n:
        tok = body[i]
        if isinstance(tok, str):
            if tok.strip():
                return None
            i += 1
            continue
        if not tok.is_("open", "argument") or "key" not in tok.attrs:
            return None
        parts: list[str] = []
        j = i + 1
        while j < n and not (isinstance(body[j], Marker) and body[j].is_("close", "argument")):
            part = body[j]
            if isinstance(part, Marker):
                if part.name == "argument":
                    return None
                part = part.raw
            parts.append(part)
            j += 1
        if j == n:
            return None
        value = "".join(parts)
        if tok.attrs.get("type", "string") == "string":
            args[tok.attrs["key"]] = value
        else:
            try:
                args[tok.attrs["key"]] = json.loads(value, parse_constant=_reject_constant)
            except ValueError:
                return None
        i = j + 1
    return name, json.dumps(args, ensure_ascii=False)
