"""AsyncEngine: the LLMEngine stepped by a background thread, with per-request asyncio
streams for the server. A request whose stream is closed early (client disconnect,
cancellation) is aborted at once, which frees its cache rows."""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import AsyncIterator

from .engine import LLMEngine
from .params import SamplingParams
from .request import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop failed; the message carries the original error."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05):
        self.engine = engine
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. Raises ValueError for a request
        the engine refuses (too long, bad ids) before anything is generated."""
        if self.dead:
            raise EngineDeadError(self.dead)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def stats(self) -> dict:
        """A consistent snapshot of the engine's counters and cache use."""
        with self._lock:
            e = self.engine
            return {**e.stats, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                    "preemptions_total": e.scheduler.num_preemptions, "cache_rows": e.pool.num_rows,
                    "cache_rows_free": e.pool.num_free}

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        stop = getattr(self.engine, "shutdown", None)
        if stop:
            stop()

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, queue = target
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    for out in outputs:
                        self._deliver(out.request_id, out)
            except Exception as e:  # the engine is unusable: fail every open stream, refuse new work
                self.dead = f"engine step failed: {type(e).__name__}: {e}"
                traceback.print_exc()
                with self._lock:
                    for request_id in list(self._streams):
                        self._deliver(request_id, EngineDeadError(self.dead))
                        self.engine.abort_request(request_id)
                return
            if not busy:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
