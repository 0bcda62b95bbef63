"""Continuous batching with chunked prefill, an adaptive token budget, preemption by
recompute, and immediate release of a cancelled request's rows.

Each step: running requests first (a decode token, or the next chunk of a prompt), then
waiting requests in arrival order while there is token budget, a free sequence slot and
cache rows. The token budget is `max_num_batched_tokens`, except while at most
`adaptive_max_requests` requests are in the system: then a waiting prompt is prefilled in one
forward call up to `adaptive_token_limit` (a memory bound: the AttnRes block bank and other
activations per token in flight), because splitting a lone request only delays its first
token. When rows run out, the most recently arrived running request is preempted: its rows
are freed and it waits to be recomputed from its prompt and the tokens it already produced.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from k3.cache.block_pool import BlockPool

from .request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    adaptive_max_requests: int = 2
    adaptive_token_limit: int = 0        # 0: no adaptive budget


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int                  # tokens this step computes for it

    @property
    def completes(self) -> bool:
        """After this step every known token is computed: a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config, self.pool = config, pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- bookkeeping
    def add(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"the request has {request.num_tokens} tokens; the limit is "
                             f"{self.config.max_model_len - 1} (max model length {self.config.max_model_len})")
        self.waiting.append(request)

    def release(self, request: Request) -> None:
        """Free every row the request holds (finish, abort or preemption)."""
        self.pool.free(request.rows + ([request.state_row] if request.state_row is not None else []))
        request.rows, request.state_row = [], None

    def finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- scheduling
    def _rows_needed(self, request: Request, num_new: int) -> int:
        return math.ceil((request.num_computed_tokens + num_new) / self.config.block_size) - len(request.rows)

    def _grow(self, request: Request, num_new: int) -> bool:
        need = self._rows_needed(request, num_new) + (1 if request.state_row is None else 0)
        if need <= 0:
            return True
        rows = self.pool.allocate(need)
        if rows is None:
            return False
        if request.state_row is None:
            request.state_row = rows.pop(0)
        request.rows += rows
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.release(request)
        request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _budget(self) -> int:
        c = self.config
        few = len(self.running) + len(self.waiting) <= c.adaptive_max_requests
        return max(c.max_num_batched_tokens, c.adaptive_token_limit) if few else c.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._budget()
        for request in list(self.running):
            if request not in self.running or budget <= 0:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request in self.running:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are in the cache."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
