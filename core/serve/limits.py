"""Per-request bounds of `k3 serve`: the body size (`BodyLimit`, an ASGI middleware, 413) and
the prompt work one request may ask for (`check_prompt_work`, 400), so one client cannot stall
the event loop or the engine for everyone else."""

from __future__ import annotations

import json

from .errors import bad_request

DEFAULT_MAX_BODY_BYTES = 16 << 20     # holds a 1M-token prompt as text or as token ids
DEFAULT_MAX_PROMPTS = 64


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 with an OpenAI error
    body before the app parses it -- at once from its Content-Length, or as soon as a chunked
    body passes the limit. The body is read here (the app reads it whole anyway) and handed on
    in one piece; later messages (the client's disconnect) pass through."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be at least 1 byte, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # gone before the body ended
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._refuse(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"error": {"message": f"the request body exceeds the server's limit of {self.max_bytes} "
                                                "bytes (--max-request-body-bytes)", "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def check_prompt_work(prompt_lengths: list[int], *, max_prompts: int, max_prompt_tokens: int) -> None:
    """400 when one request brings more prompts, or more prompt tokens in all, than the server
    takes from one request (`--max-prompts-per-request`, `--max-prompt-tokens-per-request`)."""
    if len(prompt_lengths) > max_prompts:
        raise bad_request(f"{len(prompt_lengths)} prompts in one request exceed the server's limit of {max_prompts} "
                          "(--max-prompts-per-request)", param="prompt", code="too_many_prompts")
    total = sum(prompt_lengths)
    if total > max_prompt_tokens:
        raise bad_request(f"the request's prompts hold {total} tokens in all, over the server's limit of "
                          f"{max_prompt_tokens} per request (--max-prompt-tokens-per-request)", param="prompt",
                          code="too_many_prompt_tokens")
