"""OpenAI-style chat input, checked and normalised for the renderers.

Every problem raises :class:`ChatTemplateError` with one sentence that names the message
(``messages[3]``) or tool (``tools[1]``) at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from k3.chat.errors import ChatTemplateError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Call:
    """One tool call of an assistant message: ``arguments`` parsed, ``raw`` as the client sent it."""

    id: str | None
    name: str
    arguments: dict
    raw: str


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(text: str) -> Any:
    """``json.loads`` that also refuses NaN and Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


def compact_json(value: Any) -> str:
    """JSON with no spaces, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def deep_sorted(value: Any) -> Any:
    """``value`` with every mapping's keys sorted, recursively."""
    if isinstance(value, Mapping):
        return {k: deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [deep_sorted(v) for v in value]
    return value


def role_of(msg: Any, where: str) -> str:
    """The message's role (``developer`` stays ``developer``; renderers treat it as system)."""
    if not isinstance(msg, Mapping):
        raise ChatTemplateError(f"{where} must be an object, not {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"{where} has unknown role {role!r} (expected one of {', '.join(ROLES)})")
    return role


def text_of(content: Any, where: str) -> str:
    """Content as text: a string, None, or a list of text parts (joined with nothing between)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ChatTemplateError(f"{where}.content must be a string or a list of parts")
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ChatTemplateError(
                f"{where}.content[{j}] of type {kind!r} is not supported: k3 chat takes text parts only")
        out.append(part["text"])
    return "".join(out)


def optional_str(msg: Mapping, key: str, where: str) -> str | None:
    value = msg.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{where}.{key} must be a string")
    return value or None


def calls_of(msg: Mapping, where: str) -> list[Call]:
    """The assistant message's tool calls; arguments must be a JSON object (string or dict)."""
    raw_calls = msg.get("tool_calls") or []
    if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, str):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    calls = []
    for j, tc in enumerate(raw_calls):
        at = f"{where}.tool_calls[{j}]"
        fn = tc.get("function", tc) if isinstance(tc, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{at} needs a function with a non-empty name")
        args = fn.get("arguments")
        if args is None or (isinstance(args, str) and not args.strip()):
            parsed, raw = {}, "{}"
        elif isinstance(args, str):
            try:
                parsed, raw = loads_strict(args), args
            except ValueError as e:
                raise ChatTemplateError(f"{at}.function.arguments is not valid JSON ({e})") from None
        elif isinstance(args, Mapping):
            parsed, raw = dict(args), compact_json(args)
        else:
            raise ChatTemplateError(f"{at}.function.arguments must be a JSON object string")
        if not isinstance(parsed, dict):
            raise ChatTemplateError(f"{at}.function.arguments must be a JSON object, not {type(parsed).__name__}")
        call_id = tc.get("id")
        calls.append(Call(None if call_id is None else str(call_id), fn["name"], parsed, raw))
    return calls


def tool_specs(tools: Any, where: str = "tools") -> list[dict]:
    """Check tool specs: each an object with a name (OpenAI ``{"type": "function", "function":
    {"name": ...}}`` or a bare ``{"name": ...}``). Returned unchanged, as a list."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ChatTemplateError(f"{where} must be a list of tool specs")
    for j, spec in enumerate(tools):
        if not tool_name(spec):
            raise ChatTemplateError(f"{where}[{j}] is not an object with a function name")
    return list(tools)


def tool_name(spec: Any) -> str | None:
    """The function name of a tool spec, or None when it has none."""
    if not isinstance(spec, Mapping):
        return None
    fn = spec.get("function", spec)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) and name else None


class ToolResultMatcher:
    """Matches tool messages to the calls of the latest assistant message.

    By ``tool_call_id`` when given, else by ``name`` (the first unanswered call of that name), else
    the first unanswered call. A result with no such call, or a second result for one call, is an
    error.
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._answered: set[int] = set()

    def start_turn(self, calls: list[Call]) -> None:
        self.calls, self._answered = calls, set()

    def match(self, msg: Mapping, where: str) -> int:
        """The 0-based position of the call that ``msg`` answers."""
        call_id, name = msg.get("tool_call_id"), msg.get("name")
        if call_id is not None:
            found = [p for p, c in enumerate(self.calls) if c.id == str(call_id)]
            what = f"tool_call_id {str(call_id)!r}"
        elif name:
            found = [p for p, c in enumerate(self.calls) if c.name == name and p not in self._answered]
            what = f"name {name!r}"
        else:
            found = [p for p in range(len(self.calls)) if p not in self._answered]
            what = "position"
        if not found:
            raise ChatTemplateError(
                f"{where} (tool result) matches no tool call of the preceding assistant message by {what}")
        if found[0] in self._answered:
            raise ChatTemplateError(f"{where} answers tool call {self.calls[found[0]].name!r} a second time")
        self._answered.add(found[0])
        return found[0]
