"""The consumer role (decode instance): pull a producer's rows into this engine's cache, then
decode; any failure falls back to local prefill.

`start` (engine thread) checks the handle against this engine (row format, block size, the
prompt's digest and length), reuses the full blocks its prefix cache already holds for the
prompt (those rows are not transferred), allocates the rest plus a state row, and hands the
pulls to a worker thread: one backend read per row, then a confirm that must answer "still
pinned". `poll` (engine thread, between steps) admits finished pulls into the scheduler with
the prompt computed and the producer's first token appended, and sends failed, timed-out or
unconfirmed ones to the scheduler as ordinary requests (local prefill). Rows a pull writes
into are never freed while it runs: an aborted or timed-out pull gives them back once its
thread is done.

Under tensor parallelism the TP leader's consumer allocates the rows for all its ranks and
each rank reads its own shard (`k3.engine.kv_transfer.plan`: whole rows from the producer rank
of the same index when the TP sizes match, the KDA state re-sharded by heads when they differ);
the followers' reads go to them as one `pull` call each (`k3.engine.kv_transfer.ranks`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from k3.cache.block_pool import BlockPool
from k3.cache.pool import CachePool
from k3.cache.prefix import PrefixCache
from k3.log import get_logger

from ..request import Request
from ..scheduler import allocate_rows
from .backend import TransferBackend
from .config import KVTransferConfig
from .handle import TransferHandle, layout_at_tp, layout_digest, prompt_digest
from .plan import Read, rank_reads
from .ranks import RankEndpoint, RankPulls, endpoint_of, serve_pulls
from .wire import TransferError

logger = get_logger(__name__)


@dataclass
class Pull:
    """One request's transfer: `pairs` (producer row, local row), the last one the state row."""

    request: Request
    handle: TransferHandle
    shared: list[int]               # this engine's cached rows of the first blocks (not transferred)
    own: list[int]                  # fresh rows: the remaining attention rows, then the state row
    pairs: list[tuple[int, int]]
    future: Future
    deadline: float
    nbytes: int = 0                 # bytes read over every TP rank
    seconds: float = 0.0            # the pull's wall time, once admitted

    @property
    def rows(self) -> list[int]:
        return self.shared + self.own


def _log(message: str) -> None:
    logger.warning(f"kv_consumer: {message}")


class KVConsumer:
    def __init__(self, config: KVTransferConfig, backend: TransferBackend, cache: CachePool, pool: BlockPool,
                 prefix_cache: PrefixCache | None, *, registered: int | None = None):
        """registered: the cache's base address when the backend has it registered already (kv_both)."""
        self.config, self.backend, self.cache, self.pool, self.prefix_cache = config, backend, cache, pool, prefix_cache
        self.base = registered if registered is not None else backend.register(cache.backing)
        self.layout_digest = layout_digest(cache)
        self.row_bytes, self.block_size = cache.layout.row_bytes, cache.layout.block_size
        self.tp_size = cache.format.tensor_parallel_size
        self.heads = cache.cfg.linear_attn.num_heads if cache.cfg.linear_attn is not None else 0
        # this TP group's endpoints in TP order (ranks.share_endpoints sets them under TP)
        self.ranks: list[RankEndpoint] = [endpoint_of(self)]
        serve_pulls(backend, config.transfer_timeout_s)        # a TP follower's part of a pull
        self.rank_pulls = RankPulls(backend, config.transfer_timeout_s, config.max_inflight)
        self.inflight: list[Pull] = []
        self.abandoned: list[Pull] = []        # timed out or aborted, thread still running
        self.pending: deque[Request] = deque()
        self._pool = ThreadPoolExecutor(max_workers=config.max_inflight, thread_name_prefix="k3-kv-pull")
        self.stats = {"pulls": 0, "rows_pulled": 0, "rows_skipped": 0, "bytes_pulled": 0, "fallbacks": 0,
                      "pull_seconds": 0.0}

    @staticmethod
    def wants(request: Request) -> bool:
        params = request.params.kv_transfer_params
        return (bool(params and params.get("do_remote_prefill")) and request.params.n == 1
                and request.params.prompt_logprobs is None)

    @property
    def busy(self) -> bool:
        return bool(self.inflight or self.abandoned or self.pending)

    # ------------------------------------------------------------------ engine thread
    def start(self, request: Request) -> bool:
        """Begin pulling `request`'s rows; False when it must be prefilled locally instead."""
        if len(self.inflight) >= self.config.max_inflight:
            self.pending.append(request)
            return True
        try:
            handle, source = self._check(request)
        except ValueError as e:
            _log(f"request {request.request_id}: prefilling locally ({e})")
            return False
        shared = (self.prefix_cache.lookup_rows(request.prompt_token_ids, request.media_spans,
                                                  salt=request.cache_salt)
                  if self.prefix_cache is not None else [])
        self.pool.incref(shared)
        skip = len(shared)
        own = self._allocate(len(handle.rows) - skip + 1)
        if own is None:
            self.pool.free(shared)
            _log(f"request {request.request_id}: no free rows for the transfer, prefilling locally")
            return False
        pairs = list(zip(handle.rows[skip:], own[:-1])) + [(handle.state_row, own[-1])]
        reads = [rank_reads(handle, source, self.cache.layout, heads=self.heads, dst_tp=self.tp_size, dst_rank=r,
                            dst_base=self.ranks[r].base, pairs=pairs) for r in range(self.tp_size)]
        future = self._pool.submit(self._pull, handle, reads)
        self.inflight.append(Pull(request, handle, shared, own, pairs, future,
                                  deadline=time.monotonic() + self.config.transfer_timeout_s,
                                  nbytes=sum(r.nbytes for rank in reads for r in rank)))
        self.stats["rows_skipped"] += skip
        return True

    def _check(self, request: Request):
        """(the handle, the producer's row layout); ValueError saying why the rows cannot be used."""
        handle = TransferHandle.from_params(request.params.kv_transfer_params)
        prompt = request.prompt_token_ids
        if len(self.ranks) != self.tp_size:
            raise ValueError(f"the endpoints of this engine's {self.tp_size} TP ranks are not known")
        if handle.block_size != self.block_size:
            raise ValueError(f"the producer's rows hold {handle.block_size} tokens, this engine's {self.block_size} "
                             "(give both the same --block-size)")
        source, digest = ((self.cache.layout, self.layout_digest) if handle.tp_size == self.tp_size
                          else layout_at_tp(self.cache, handle.tp_size))
        if handle.layout_digest != digest or handle.row_bytes != source.row_bytes:
            raise ValueError(f"the producer's cache rows (TP size {handle.tp_size}) have another format than this "
                             f"engine's (TP size {self.tp_size}) beyond the KDA heads' split: the model, dtypes, "
                             "kv / index cache dtypes, alignment or KDA state layout differ")
        if self.heads and (self.heads % handle.tp_size):
            raise ValueError(f"the producer's TP size {handle.tp_size} does not divide the {self.heads} KDA heads")
        if handle.num_tokens != len(prompt) or handle.prompt_digest != prompt_digest(prompt):
            raise ValueError("the handle was made for another prompt")
        if len(handle.rows) != math.ceil(len(prompt) / self.block_size) or handle.state_row is None:
            raise ValueError(f"the handle names {len(handle.rows)} attention rows for {len(prompt)} tokens")
        if request.output_token_ids:
            raise ValueError("the request already has output tokens")
        return handle, source

    def _allocate(self, n: int) -> list[int] | None:
        return allocate_rows(self.pool, self.prefix_cache, n)

    def poll(self) -> tuple[list[Request], list[Request]]:
        """(requests whose rows arrived, requests to prefill locally); engine thread. An
        admitted request holds its rows with its prompt computed; the caller appends the
        producer's first token and queues it."""
        admitted, fallback, still = [], [], []
        now = time.monotonic()
        for pull in self.inflight:
            request = pull.request
            if request.finished:                      # aborted meanwhile
                self.abandoned.append(pull)
            elif pull.future.done():
                error = pull.future.exception()
                if error is None:
                    self._admit(pull)
                    admitted.append(request)
                else:
                    _log(f"request {request.request_id}: transfer failed ({error}), prefilling locally")
                    self.pool.free(pull.rows)
                    fallback.append(request)
            elif now >= pull.deadline:
                _log(f"request {request.request_id}: transfer timed out after {self.config.transfer_timeout_s} s, "
                     "prefilling locally")
                self.abandoned.append(pull)
                fallback.append(request)
            else:
                still.append(pull)
        self.inflight = still
        done = [p for p in self.abandoned if p.future.done()]
        for pull in done:
            self.pool.free(pull.rows)
        self.abandoned = [p for p in self.abandoned if not p.future.done()]
        self.stats["fallbacks"] += len(fallback)
        while self.pending and len(self.inflight) < self.config.max_inflight:
            request = self.pending.popleft()
            if not request.finished and not self.start(request):
                self.stats["fallbacks"] += 1
                fallback.append(request)
        return admitted, fallback

    def _admit(self, pull: Pull) -> None:
        request, handle = pull.request, pull.handle
        request.rows, request.state_row = pull.shared + pull.own[:-1], pull.own[-1]
        request.num_computed_tokens = handle.num_tokens
        request.prefix_hit_tokens = len(pull.shared) * self.block_size
        unit = self.prefix_cache.unit if self.prefix_cache is not None else 1
        request.prefix_units = request.prefix_hit_tokens // unit if self.prefix_cache is not None else 0
        self.stats["pulls"] += 1
        self.stats["rows_pulled"] += len(pull.pairs)
        self.stats["bytes_pulled"] += pull.nbytes
        pull.seconds = pull.future.result()
        self.stats["pull_seconds"] += pull.seconds

    # ------------------------------------------------------------------ worker thread
    def _pull(self, handle: TransferHandle, reads: list[list[Read]]) -> float:
        """Every TP rank reads its rows (reads[r]), then confirm; the seconds it took
        (TransferError on failure)."""
        t0 = time.perf_counter()
        self.rank_pulls.run(self.ranks, reads)
        if not self.backend.confirm(handle.remote_control, handle.transfer_id):
            raise TransferError(f"the producer's pin {handle.transfer_id} expired before the confirm")
        return time.perf_counter() - t0

    def idle_wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a pull to finish: an engine with nothing else to run waits
        here instead of spinning (which would also starve the pull threads of the GIL)."""
        futures = [p.future for p in self.inflight + self.abandoned]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait(self, timeout_s: float = 30.0) -> None:
        """Block until every in-flight pull's thread is done (tests, benchmarks)."""
        for pull in list(self.inflight):
            try:
                pull.future.result(timeout=timeout_s)
            except Exception:  # noqa: BLE001 - poll reports it
                pass

    def close(self) -> None:
        """Stop the pull threads (the engine closes the backend)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.rank_pulls.close()
