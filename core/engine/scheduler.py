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
Images (k3.engine.media): the images a step's chunks reach that are not encoded yet share a
per-step encoder budget (`max_num_encoder_tokens`); a chunk stops before an image that does not
fit (and the request waits a step if it starts at one). A request's encoder outputs are dropped
when it finishes or is aborted, kept across a preemption.
Token-sharded prefill (`token_sharded_min_tokens`, k3.engine.sharded_prefill): a waiting fresh
prompt whose first chunk is that long is scheduled alone, in a step that alternates with the
ordinary ones while others run; the runners then split its prefill over the TP ranks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from k3.cache.block_pool import BlockPool
from k3.dtypes import legacy_rounding
from k3.cache.prefix import PrefixCache

from .media import tokens_to_encode
from .request import Request, RequestStatus
from .step_tokens import StepTokenHistogram


def allocate_rows(pool, prefix_cache, n: int) -> list[int] | None:
    """n rows of `pool`, evicting cached prefixes (when there is a prefix cache) if it is short;
    None when even that does not free enough."""
    rows = pool.allocate(n)
    if rows is None and prefix_cache is not None:
        prefix_cache.evict(n - pool.num_free)
        rows = pool.allocate(n)
    return rows


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    adaptive_max_requests: int = 2
    adaptive_token_limit: int = 0        # 0: no adaptive budget
    checkpoint_interval: int = 0         # prefix caching: extra KDA checkpoints every N tokens (0: none)
    # image placeholders whose images the vision encoder may encode in one step (0: no images)
    max_num_encoder_tokens: int = 0
    # token-sharded prefill (k3.engine.sharded_prefill): a fresh prompt whose first chunk has at
    # least this many tokens gets a step of its own (0: off)
    token_sharded_min_tokens: int = 0


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int                  # tokens this step computes for it
    checkpoints: list[tuple[int, int]] = field(default_factory=list)   # (position, state row) to save
    # a decode launched before the previous step's token reached the host (asynchronous
    # scheduling): its one input token is that token, taken on the device from the previous
    # step's samples; `tokens` holds a placeholder and the output index is one further on
    lookahead: bool = False

    def __post_init__(self):
        # a lookahead samples the output after the one still on the device: fixed now, as the
        # host appends that one while this step runs
        self._lookahead_index = len(self.request.output_token_ids) + 1 if self.lookahead else None

    @property
    def spec_tokens(self) -> list[int]:
        """Drafts this step verifies (after the request's last token)."""
        return self.request.spec_tokens if self.num_new_tokens > 1 else []

    @property
    def tokens(self) -> list[int]:
        """The tokens this step computes (a lookahead decode: a placeholder, replaced on the device)."""
        if self.lookahead:
            return [0]
        start = self.request.num_computed_tokens
        return (self.request.all_token_ids + self.spec_tokens)[start: start + self.num_new_tokens]

    @property
    def decode(self) -> bool:
        """One generated token (not a prompt chunk, not a verify step): a decode, which the layers
        run on their decode path (`ForwardMetadata.num_decodes`)."""
        r = self.request
        return self.num_new_tokens == 1 and (self.lookahead or r.num_computed_tokens >= len(r.prompt_token_ids))

    @property
    def completes(self) -> bool:
        """After this step every known token is computed: a new token is sampled."""
        r = self.request
        return self.lookahead or r.num_computed_tokens + self.num_new_tokens == r.num_tokens + len(self.spec_tokens)

    @property
    def output_index(self) -> int:
        """Index among the request's outputs of the token this step samples (read at launch)."""
        return self._lookahead_index if self.lookahead else len(self.request.output_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    row_copies: list[tuple[int, int]] = field(default_factory=list)    # (src, dst) before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, prefix_cache: PrefixCache | None = None):
        self.config, self.pool, self.prefix_cache = config, pool, prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_tokens = StepTokenHistogram()     # tokens per committed step (vLLM's iteration_tokens_total)
        # prefill/decode disaggregation (k3.engine.kv_transfer): a producer publishes the rows of
        # a finished prefill instead of freeing them; a consumer pulls a request's rows before
        # it is queued (it queues it itself, or refuses and the request waits for local prefill)
        self.kv_producer = None
        self.kv_consumer = None
        self._sharded_last = False         # the previous step was a token-sharded prefill

    # ----------------------------------------------------------------- bookkeeping
    def add(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(f"the request has {request.num_tokens} tokens; the limit is "
                             f"{self.config.max_model_len - 1} (max model length {self.config.max_model_len})")
        if self.kv_consumer is not None and self.kv_consumer.wants(request) and self.kv_consumer.start(request):
            return
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
        if reason != "abort" and self.kv_producer is not None and self.kv_producer.wants(request):
            request.kv_transfer_params = self.kv_producer.publish(request)   # takes the rows, pinned
        self.release(request)
        if request.media is not None:
            request.media.free()             # its encoder outputs go with it
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- scheduling
    def _rows_needed(self, request: Request, num_new: int) -> int:
        return math.ceil((request.num_computed_tokens + num_new) / self.config.block_size) - len(request.rows)

    def _allocate(self, n: int) -> list[int] | None:
        return allocate_rows(self.pool, self.prefix_cache, n)

    def _grow(self, request: Request, num_new: int) -> bool:
        need = self._rows_needed(request, num_new) + (1 if request.state_row is None else 0)
        if need <= 0:
            return True
        rows = self._allocate(need)
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
        request.prefix_hit_tokens = request.prefix_units = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _budget(self) -> int:
        c = self.config
        few = len(self.running) + len(self.waiting) <= c.adaptive_max_requests
        return max(c.max_num_batched_tokens, c.adaptive_token_limit) if few else c.max_num_batched_tokens

    def _fit_encoder(self, request: Request, num_new: int, encoder_budget: list[int]) -> int:
        """The chunk's tokens that fit the step's encoder budget (encoder_budget[0], decreased by
        the images this chunk encodes): it stops before an image that does not fit."""
        if request.media is None:
            return num_new
        num_new, used = tokens_to_encode(request.media, request.num_computed_tokens, num_new, encoder_budget[0])
        encoder_budget[0] -= used
        return num_new

    def _shards(self, request: Request, budget: int) -> bool:
        """The request's next chunk is a token-sharded prefill: a fresh text prompt (no
        prompt log-probs) whose chunk has at least `token_sharded_min_tokens` tokens."""
        n = self.config.token_sharded_min_tokens
        return (n > 0 and request.num_computed_tokens == 0 and request.media is None
                and not request.params.prompt_logprobs and min(request.num_tokens, budget) >= n)

    def _schedule_sharded(self) -> SchedulerOutput | None:
        """A step of its own for the first waiting request when it `_shards` (every rank's
        runner then prefills it token-sharded). Such steps alternate with ordinary ones while
        other requests run, so their decodes wait at most one step."""
        budget = self._budget()
        if (not self.waiting or len(self.running) >= self.config.max_num_seqs
                or not self._shards(self.waiting[0], budget) or (self._sharded_last and self.running)):
            return None
        request = self.waiting[0]
        num_new = min(request.num_tokens, budget)
        if not self._grow(request, num_new):
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        self.running.append(request)
        return SchedulerOutput(scheduled=[ScheduledRequest(request, num_new)])

    def schedule(self) -> SchedulerOutput:
        sharded = self._schedule_sharded() if self.config.token_sharded_min_tokens else None
        self._sharded_last = sharded is not None
        if sharded is not None:
            return sharded
        out = SchedulerOutput()
        budget = self._budget()
        encoder_budget = [self.config.max_num_encoder_tokens]
        for request in list(self.running):
            if request not in self.running or budget <= 0:
                continue
            num_new = self._fit_encoder(request, min(request.num_tokens - request.num_computed_tokens, budget),
                                        encoder_budget)
            if num_new == 0:
                continue                     # its next image waits for the encoder budget
            if request.spec_tokens:          # a verify step: the last token and every draft, or none
                if num_new == 1 and 1 + len(request.spec_tokens) <= budget:
                    num_new += len(request.spec_tokens)
                else:
                    request.spec_tokens, request.spec_probs = [], None
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
            if self._shards(request, self._budget()):
                break                        # it waits for a step of its own (_schedule_sharded)
            if self.prefix_cache is not None and request.num_computed_tokens == 0 and request.state_row is None:
                self._reuse_prefix(request, out)
            num_new = self._fit_encoder(request, min(request.num_tokens - request.num_computed_tokens, budget),
                                        encoder_budget)
            if num_new == 0 or not self._grow(request, num_new):
                self._undo_prefix(request, out)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if self.prefix_cache is not None:
            for s in out.scheduled:
                s.checkpoints = self._plan_checkpoints(s.request, s.num_new_tokens)
        # decodes first (ForwardMetadata.num_decodes): layers run them on their decode path and the
        # prompt chunks (of one token too) on the prefill path, so neither depends on the other
        # sharing its batch (K3_LEGACY_ROUNDING: every one-token step first, as before issue 32)
        legacy = legacy_rounding()
        out.scheduled.sort(key=lambda s: not (s.decode or (legacy and s.num_new_tokens == 1)))
        return out

    # ----------------------------------------------------------------- prefix caching
    def _reuse_prefix(self, request: Request, out: SchedulerOutput) -> None:
        """Start a request from its longest cached prefix: share the full rows read-only, copy
        the partly used last row and the KDA checkpoint into rows of its own. A request that
        asks for prompt logprobs starts from nothing (it still registers its prefix)."""
        cache = self.prefix_cache
        tokens = request.all_token_ids
        request.checkpoint_targets = self._checkpoint_targets(len(tokens))
        if request.params.prompt_logprobs is not None:
            return              # as vLLM: every prompt position is computed (and scored), none reused
        hit = cache.lookup(tokens, media=request.media_spans, salt=request.cache_salt)
        if hit.tokens == 0:
            return
        full, partial = hit.tokens // self.config.block_size, hit.tokens % self.config.block_size != 0
        self.pool.incref(hit.rows[:full])
        own = self._allocate(1 + partial)
        if own is None:
            self.pool.free(hit.rows[:full])
            return
        request.rows = hit.rows[:full]
        request.state_row = own[0]
        if hit.checkpoint_row is not None:
            out.row_copies.append((hit.checkpoint_row, own[0]))
        if partial:
            request.rows.append(own[1])
            out.row_copies.append((hit.rows[full], own[1]))
        request.num_computed_tokens = request.prefix_hit_tokens = hit.tokens
        request.prefix_units = hit.tokens // cache.unit
        request.checkpoint_targets = [p for p in request.checkpoint_targets if p > hit.tokens]

    def _undo_prefix(self, request: Request, out: SchedulerOutput) -> None:
        """A request that could not be admitted gives its prefix rows back (it retries later)."""
        if request.prefix_hit_tokens:
            out.row_copies = [c for c in out.row_copies if c[1] not in request.rows + [request.state_row]]
            self.release(request)
            request.num_computed_tokens = request.prefix_hit_tokens = 0

    def _checkpoint_targets(self, num_tokens: int) -> list[int]:
        """KDA checkpoint positions of a prompt: its last full unit before the last token
        (floor((len - 1) / unit) * unit), plus every `checkpoint_interval` tokens."""
        unit = self.prefix_cache.unit
        last = (num_tokens - 1) // unit * unit
        targets = {last} if last > 0 else set()
        interval = self.config.checkpoint_interval
        if interval:
            targets |= set(range(interval, last + 1, interval))
        return sorted(targets)

    def _plan_checkpoints(self, request: Request, num_new: int) -> list[tuple[int, int]]:
        """State rows for the checkpoints that fall inside this step's tokens (skipped when
        the pool is short: a checkpoint is an optimisation)."""
        if not self.prefix_cache.needs_checkpoints:
            return []
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        plan = []
        for pos in [p for p in request.checkpoint_targets if start < p <= end]:
            if self.prefix_cache.has_checkpoint(request.all_token_ids, pos, media=request.media_spans,
                                                salt=request.cache_salt):
                continue
            rows = self.pool.allocate(1)
            if rows is not None:
                plan.append((pos, rows[0]))
        return plan

    def grow_for_lookahead(self, request: Request) -> bool:
        """Rows for one more decode token beyond the committed ones (asynchronous scheduling:
        the previous step's token is not on the host yet); False when the pool is short (the
        engine then schedules normally, which may preempt)."""
        return self._grow(request, 1)

    def commit(self, out: SchedulerOutput, kept: dict[str, int] | None = None) -> None:
        """After the forward: the scheduled tokens are in the cache (and, with prefix caching,
        their full units and checkpoints are registered). kept: request id -> tokens of a verify
        step that stay (1 + accepted drafts); the rest of its step is discarded."""
        if out.scheduled:
            self.step_tokens.observe(sum((kept or {}).get(s.request.request_id, s.num_new_tokens)
                                         for s in out.scheduled))
        for s in out.scheduled:
            r = s.request
            r.num_computed_tokens += (kept or {}).get(r.request_id, s.num_new_tokens)
            if self.prefix_cache is None:
                continue
            tokens = r.all_token_ids
            media, salt = r.media_spans, r.cache_salt
            r.prefix_units = self.prefix_cache.register(tokens, r.rows, r.num_computed_tokens, r.prefix_units,
                                                        media=media, salt=salt)
            for pos, row in s.checkpoints:
                self.prefix_cache.add_checkpoint(tokens, pos, row, media=media, salt=salt)
