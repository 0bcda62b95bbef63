"""AsyncEngine: the LLMEngine stepped by a background thread, with per-request asyncio
streams for the server.

Only the engine thread touches the LLMEngine. Callers hand it commands through an inbox
(add a request, abort one, finish every open one) that it drains before every step, so an event loop never waits
for a step in flight: with many clients, new requests and streamed tokens keep flowing while
the model runs. A request whose stream is closed early (client disconnect, cancellation) is
aborted before the next step, which frees its cache rows.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import traceback
from collections.abc import AsyncIterator

from .engine import LLMEngine
from .params import SamplingParams
from .request import CompletionOutput, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop failed; the message carries the original error."""


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Run fn(*args) on `loop`; False when that loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _final(request_id: str, last: RequestOutput | None, n: int, reason: str) -> RequestOutput:
    """A finished copy of a request's latest output (or an empty one, before its first
    token), every unfinished sample ending with `reason`."""
    if last is None:
        outputs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                    finish_reason=reason) for i in range(n)]
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], outputs=outputs, finished=True)
    outputs = [c if c.finish_reason is not None else dataclasses.replace(c, finish_reason=reason)
               for c in last.outputs]
    return dataclasses.replace(last, outputs=outputs, finished=True)


class AsyncEngine:
    """engine: an LLMEngine, or anything with its request interface (add_request,
    abort_request, has_unfinished_requests, step, snapshot, shutdown, tokenizer), such as the
    data-parallel front-end `k3.engine.distributed.dp_frontend.DistributedEngine`."""

    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self._inbox: collections.deque = collections.deque()   # ("add", ...) / ("abort", request_id)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._last: dict[str, RequestOutput] = {}        # each open stream's latest output
        self._samples: dict[str, int] = {}                # each open stream's n
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.dead: str | None = None
        self._snapshot = self._read_stats()
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       multi_modal_data: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. Raises ValueError for a request
        the engine refuses (too long, bad ids, images it cannot take) before anything is
        generated. multi_modal_data: its images (`LLMEngine.add_request`)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._inbox.append(("add", request_id, prompt, params, loop, queue, accepted, multi_modal_data))
        self._wake.set()
        finished = False
        try:
            await accepted
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, fn):
        """fn(engine) run on the engine thread between steps (what must not race a step: loading
        a LoRA adapter into the model's slots); returns its result or raises its exception."""
        if self.dead:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.append(("call", fn, loop, done))
        self._wake.set()
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it is unknown or done); its rows are free before the
        engine's next step. Never blocks."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def finish_all(self, reason: str = "abort") -> None:
        """End every open request now, each stream getting a final output with
        `finish_reason` = reason for its unfinished samples (the text generated so far, no
        new tokens), and free their rows: a server's drain at shutdown. Never blocks."""
        self._inbox.append(("finish_all", reason))
        self._wake.set()

    def stats(self) -> dict:
        """A consistent snapshot of the engine's counters and cache use, taken between steps.
        Rows held only by the prefix cache (`prefix_cache_rows`, `prefix_cache_checkpoint_rows`)
        are not free, but are evicted when a request needs them."""
        return dict(self._snapshot)

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        stop = getattr(self.engine, "shutdown", None)
        if stop:
            stop()

    # ------------------------------------------------------------------ engine thread
    def _read_stats(self) -> dict:
        return self.engine.snapshot()

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, queue = target
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self._forget(request_id)
        elif isinstance(item, RequestOutput):
            self._last[request_id] = item
        if not _post(loop, queue.put_nowait, item):  # nobody can read it any more
            self._forget(request_id)
            self.engine.abort_request(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._last.pop(request_id, None)
        self._samples.pop(request_id, None)

    def _finish_all(self, reason: str) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._deliver(request_id, _final(request_id, self._last.get(request_id),
                                             self._samples.get(request_id, 1), reason))

    def _drain(self) -> None:
        """Apply queued adds and aborts, in order."""
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "abort":
                self._forget(command[1])
                self.engine.abort_request(command[1])
                continue
            if command[0] == "finish_all":
                self._finish_all(command[1])
                continue
            if command[0] == "call":
                _, fn, loop, done = command
                try:
                    result = fn(self.engine)
                except Exception as e:  # the caller raises it
                    _post(loop, _settle, done, e)
                else:
                    _post(loop, _resolve, done, result)
                continue
            _, request_id, prompt, params, loop, queue, accepted, multi_modal_data = command
            try:
                if multi_modal_data:
                    self.engine.add_request(request_id, prompt, params, multi_modal_data)
                else:
                    self.engine.add_request(request_id, prompt, params)
            except Exception as e:  # refused: the caller raises it
                _post(loop, _settle, accepted, e)
                continue
            if _post(loop, _settle, accepted, None):
                self._streams[request_id] = (loop, queue)
                self._samples[request_id] = getattr(params, "n", 1) or 1
            else:
                self.engine.abort_request(request_id)

    def _fail_all(self, error: EngineDeadError) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, error)
            self.engine.abort_request(request_id)
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "add":
                _post(command[4], _settle, command[6], error)
            elif command[0] == "call":
                _post(command[2], _settle, command[3], error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._drain()
                busy = self.engine.has_unfinished_requests()
                outputs = self.engine.step() if busy else []
                self._snapshot = self._read_stats()  # before delivery: a finished stream sees its rows free
                for out in outputs:
                    self._deliver(out.request_id, out)
            except Exception as e:  # the engine is unusable: fail every open stream, refuse new work
                self.dead = f"engine step failed: {type(e).__name__}: {e}"
                traceback.print_exc()
                self._fail_all(EngineDeadError(self.dead))
                return
            if not busy and not self._inbox:
                self._wake.wait(self._idle_wait_s)
