"""The vocabulary bound of token-id request fields, in one place for validation and schema.

A schema cannot know a model's vocabulary statically, so every token-id field of
`k3.serve.protocol` (prompt ids, stop_token_ids, logit_bias keys, /detokenize tokens) is
marked `x-k3-token-id` and checked against the bound of the request's server: the app's
`TokenBound` middleware sets it for each request (a context variable, so two apps in one
process never see each other's), the pydantic validators read it (`check_token_id`,
`check_token_key`), and `publish_token_bound` writes the same number into the app's
/openapi.json (`maximum` on ids, a `propertyNames` pattern on logit_bias keys). Without a
bound (a model validated outside a server) only `>= 0` is checked.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from pydantic_core import PydanticCustomError

MARK = "x-k3-token-id"            # on an integer schema: a token id
KEY_MARK = "x-k3-token-id-keys"   # on an object schema: its keys are token ids (decimal strings)
KEY_DIGITS = 12                   # a logit_bias key has 1 to 12 digits
KEY_PATTERN = rf"^[0-9]{{1,{KEY_DIGITS}}}$"

_limit: ContextVar[int | None] = ContextVar("k3_token_id_limit", default=None)


def token_id_limit() -> int | None:
    """Token ids of the current request must be below this (None: no server, no bound)."""
    return _limit.get()


def _refuse(value: int, limit: int):
    return PydanticCustomError("token_id_out_of_vocabulary",
                               "token id {id} is outside the vocabulary (0 to {max})", {"id": value, "max": limit - 1})


def check_token_id(value: int) -> int:
    """Pydantic after-validator of a token id: below the current bound."""
    limit = _limit.get()
    if limit is not None and value >= limit:
        raise _refuse(value, limit)
    return value


def check_token_key(value: str) -> str:
    """Pydantic after-validator of a logit_bias key (already 1-12 digits): below the bound."""
    limit = _limit.get()
    if limit is not None and int(value) >= limit:
        raise _refuse(int(value), limit)
    return value


class TokenBound:
    """ASGI middleware: every request of the app it wraps is validated with `limit()`'s bound."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        token = _limit.set(self.limit()) if scope["type"] == "http" else None
        try:
            await self.app(scope, receive, send)
        finally:
            if token is not None:
                _limit.reset(token)


def key_pattern(limit: int) -> str:
    """A regular expression for the decimal strings of 1 to 12 digits (leading zeros allowed)
    whose value is below `limit`: what `check_token_key` accepts, for a JSON Schema."""
    top = str(limit - 1)
    k = len(top)
    if limit < 1 or k > KEY_DIGITS:
        return KEY_PATTERN
    fixed = []   # exactly k digits, value <= top
    for i, d in enumerate(top):
        if d != "0":
            rest = k - i - 1
            fixed.append(top[:i] + (f"[0-{int(d) - 1}]" if d != "1" else "0") + (f"[0-9]{{{rest}}}" if rest else ""))
    fixed.append(top)
    shorter = [f"[0-9]{{1,{k - 1}}}"] if k > 1 else []
    zeros = f"0{{0,{KEY_DIGITS - k}}}" if KEY_DIGITS > k else ""
    return "^(?:" + "|".join(shorter + [f"{zeros}(?:{'|'.join(fixed)})"]) + ")$"


def publish_token_bound(schema: dict, limit: int) -> dict:
    """`schema` (an OpenAPI document) with the bound on every marked token-id field, in place."""
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get(MARK):
                node["maximum"] = limit - 1
            if node.get(KEY_MARK):
                node["propertyNames"] = {"pattern": key_pattern(limit)}
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema
