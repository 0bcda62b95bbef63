"""The producer role (prefill instance): publish a finished prefill's rows, keep them pinned
until the consumer confirms (or the pin times out), then free them.

A request asks to be published with kv_transfer_params {"do_remote_decode": true}; the engine
runs it with max_tokens 1 (its prefill and first token) and, when it finishes, `publish` takes
over its rows instead of the scheduler freeing them. Confirms arrive on the backend's control
thread; only the engine thread touches the row allocator, so a confirmed or expired pin is
queued and freed by `poll` between steps. A confirm answers False once a pin has expired, and
a pin expires only if it was not confirmed, both under one lock: every byte a consumer read
before a True answer was the request's.

Under tensor parallelism only the TP leader's producer pins and publishes (its allocator owns
the rows of every rank); the handle names every TP rank's data endpoint and cache base, and the
followers' backends serve reads of their shards of the same rows.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from k3.cache.block_pool import BlockPool
from k3.cache.pool import CachePool

from ..request import Request
from .backend import TransferBackend
from .config import KVTransferConfig
from .handle import TransferHandle, layout_digest, prompt_digest
from .ranks import RankEndpoint, endpoint_of


@dataclass
class Pin:
    rows: list[int]                 # attention rows + the state row, one pool reference each
    deadline: float
    state: str = "pinned"           # pinned -> confirmed | expired


class KVProducer:
    def __init__(self, config: KVTransferConfig, backend: TransferBackend, cache: CachePool, pool: BlockPool):
        self.config, self.backend, self.cache, self.pool = config, backend, cache, pool
        self.base = backend.register(cache.backing)
        self.layout_digest = layout_digest(cache)
        self.pins: dict[str, Pin] = {}
        self._release: list[str] = []
        self._lock = threading.Lock()
        self.stats = {"published": 0, "confirmed": 0, "expired": 0}
        # this TP group's endpoints in TP order (ranks.share_endpoints sets them under TP)
        self.ranks: list[RankEndpoint] = [endpoint_of(self)]
        backend.on_confirm(self._confirmed)

    @staticmethod
    def wants(request: Request) -> bool:
        params = request.params.kv_transfer_params
        return bool(params and params.get("do_remote_decode")) and request.params.n == 1

    def publish(self, request: Request) -> dict:
        """Pin the finished request's rows (taking its pool references) and return its handle
        as kv_transfer_params. Engine thread."""
        rows, state = list(request.rows), request.state_row
        request.rows, request.state_row = [], None
        transfer_id = uuid.uuid4().hex
        top = None
        if request.output_top_logprobs:
            pairs = request.output_top_logprobs[0]
            top = (tuple(t for t, _ in pairs), tuple(v for _, v in pairs))
        handle = TransferHandle(
            transfer_id=transfer_id, remote_engine_id=self.config.engine_id, remote_control=self.backend.control,
            remote_data=self.backend.data, remote_base=self.base, row_bytes=self.cache.layout.row_bytes,
            block_size=self.cache.layout.block_size, layout_digest=self.layout_digest,
            num_tokens=len(request.prompt_token_ids), prompt_digest=prompt_digest(request.prompt_token_ids),
            rows=tuple(rows), state_row=state, first_token=request.output_token_ids[0],
            first_logprob=request.output_logprobs[0], first_top=top,
            ranks=tuple((r.data, r.base) for r in self.ranks) if len(self.ranks) > 1 else ())
        with self._lock:
            self.pins[transfer_id] = Pin(rows + ([state] if state is not None else []),
                                         time.monotonic() + self.config.pin_timeout_s)
        self.stats["published"] += 1
        return handle.to_params()

    def _confirmed(self, transfer_id: str) -> bool:
        """The consumer is done reading (control thread): True while the rows were pinned."""
        with self._lock:
            pin = self.pins.get(transfer_id)
            if pin is None or pin.state != "pinned":
                return False
            pin.state = "confirmed"
            self._release.append(transfer_id)
            self.stats["confirmed"] += 1
            return True

    def due(self) -> bool:
        """Pins to free now (confirmed, or past their deadline): the engine should call poll."""
        now = time.monotonic()
        with self._lock:
            return bool(self._release) or any(p.state == "pinned" and p.deadline <= now for p in self.pins.values())

    def poll(self) -> int:
        """Free confirmed and expired pins' rows (engine thread); returns the rows freed."""
        now = time.monotonic()
        with self._lock:
            for tid, pin in self.pins.items():
                if pin.state == "pinned" and pin.deadline <= now:
                    pin.state = "expired"
                    self._release.append(tid)
                    self.stats["expired"] += 1
            done, self._release = self._release, []
            freed = [self.pins.pop(tid).rows for tid in done]
        for rows in freed:
            self.pool.free(rows)
        return sum(len(r) for r in freed)

    @property
    def num_pinned_rows(self) -> int:
        with self._lock:
            return sum(len(p.rows) for p in self.pins.values())

