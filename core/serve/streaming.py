"""Driving engine streams for a request: several prompts at once, server-sent events, and
cancellation when the client goes away (closing an AsyncEngine stream aborts its request; its
cache rows are free before the engine's next step)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from k3.engine.request import RequestOutput

DONE = "data: [DONE]\n\n"
_END = object()


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs as they arrive from all `streams`.

    The first error of any stream is raised here. Closing this iterator (client disconnect,
    an error) cancels every stream still running, which aborts their requests."""
    if len(streams) == 1:  # the common case: no tasks needed
        stream = streams[0]
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, _END))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(receive) -> None:
    """Returns once the client has closed the connection (the request body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """Server-sent events from an async generator. The generator is closed as soon as the
    client disconnects, also while no event is due (a request still waiting for its first
    token), which aborts its requests; it is always closed when the response ends."""

    media_type = "text/event-stream"

    def __init__(self, content):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({streaming, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watch):
                task.cancel()
            await asyncio.gather(streaming, watch, return_exceptions=True)
            await self.body_iterator.aclose()
        if streaming.done() and not streaming.cancelled():
            error = streaming.exception()
            if error is not None and not isinstance(error, OSError):  # OSError: the client is gone
                raise error


async def collect(request: Request, streams: list[AsyncIterator[RequestOutput]],
                  on_output=None) -> list[RequestOutput] | None:
    """The final output of every stream, or None when the client disconnected first (the
    requests are then aborted). `on_output(index, output)` sees every output on the way."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        merged = merge(streams)
        try:
            async for i, out in merged:
                finals[i] = out
                if on_output:
                    on_output(i, out)
        finally:
            await merged.aclose()

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return None
    work.result()  # re-raise the engine's error, if any
    return finals  # type: ignore[return-value]
