"""The one error type of k3.chat."""

from __future__ import annotations


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (unknown role, a tool result without a matching
    call, tool-call arguments that are not a JSON object, a malformed tool spec, ...).

    The message is one sentence meant for the API client; the server answers it with HTTP 400.
    """
