"""The error types of k3.chat: ChatTemplateError and its ChatFormatUnavailable."""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (unknown role, a tool result without a matching
    call, tool-call arguments that are not a JSON object, a malformed tool spec, ...).

    The message is one sentence meant for the API client; the server answers it with HTTP 400.
    """


class ChatFormatUnavailable(ChatTemplateError):
    """The tokenizer lacks the marker tokens of every chat format k3 renders (or of the one its
    end-of-message token names). The message names the formats looked for and the absent
    markers; `missing` maps format ("k3" / "k2") -> the absent marker names."""

    def __init__(self, message: str, missing: dict[str, tuple[str, ...]]):
        super().__init__(message)
        self.missing = missing
