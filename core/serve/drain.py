"""Graceful shutdown: stop admitting, let running requests finish, then end the rest cleanly.

`DrainGate` is an ASGI middleware in front of the app. It counts the API requests in flight
(from the request's arrival to the last byte of its response, so a stream counts until its
`[DONE]`) and, once `drain` has begun, answers every new API request 503 with an OpenAI error
body and `Retry-After` (and /health 503, so a load balancer stops sending).

`drain(gate, engine, timeout_s)`: waits up to `timeout_s` for the requests in flight to finish
by themselves, then ends the rest through `AsyncEngine.finish_all("abort")`: a stream gets its
final chunk with `finish_reason: "abort"`, its usage and `[DONE]`; a non-streaming request a
normal response with `finish_reason: "abort"`; their cache rows are freed. Only then does the
HTTP server stop, so no connection is cut mid-response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

logger = logging.getLogger("k3.serve")

# paths still answered while draining: the probes and the metrics a scraper reads last
_ALWAYS_OPEN = ("/metrics", "/version", "/ping")
RETRY_AFTER_S = 5
FINISH_GRACE_S = 5.0     # after finish_all: time for the ended responses to be written


class DrainGate:
    """ASGI middleware: in-flight count and the refusal of new work while draining."""

    def __init__(self, app):
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.draining and not path.startswith(_ALWAYS_OPEN):
            return await _refuse(send, path)
        self.in_flight += 1
        done = False

        async def tracked_send(message):
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.in_flight -= 1

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            if not done:
                self.in_flight -= 1


async def _refuse(send, path: str) -> None:
    message = ("the server is shutting down and accepts no new requests" if path != "/health"
               else "the server is shutting down")
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "server_shutting_down"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def drain(gate: DrainGate, engine, timeout_s: float, *, poll_s: float = 0.05) -> int:
    """Stop admitting, wait up to timeout_s for the requests in flight, then end the rest
    (finish_reason "abort") and wait for their responses to be written. Returns how many
    requests were ended early."""
    gate.draining = True
    start = time.monotonic()
    logger.info("draining: %d request(s) in flight, waiting up to %g s", gate.in_flight, timeout_s)
    while gate.in_flight and time.monotonic() - start < timeout_s:
        await asyncio.sleep(poll_s)
    ended = gate.in_flight
    if ended:
        logger.warning("shutdown timeout of %g s reached: ending %d request(s) with finish_reason 'abort'",
                       timeout_s, ended)
        engine.finish_all("abort")
        deadline = time.monotonic() + FINISH_GRACE_S
        while gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
    return ended
