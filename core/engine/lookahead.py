"""Asynchronous scheduling's lookahead: the next decode step, launched before the host has read
the tokens of the step still on the device (`EngineConfig.async_scheduling`).

Between two synchronous decode steps the device waits while the host reads the tokens, appends
them, checks stops, schedules and builds the next step's metadata (about 1 ms a step for
k3-slice on the H200, BENCHMARKS.md). Here the next step is built from what the host already
knows: every request of the running step continues with one token whose value it does not know
yet, so the step's input ids are copied on the device from the running step's samples. Its
uploads are staged in page-locked memory (`ModelRunner.pinned_uploads`), since a copy from
pageable memory would first wait for the running step.

A lookahead is a plain continuation or nothing: every request of the running step sampled a
token (no prompt still prefilling), no request waits to be admitted (that needs the scheduler),
and each request's next token needs nothing the host has not got: no penalties, token masks or
min_tokens blocking (they read the outputs), no prefix-cache checkpoint at that position.
Structured-output requests do continue: their step's forward is launched at once and only its
sampling waits (`ModelRunner.run(defer_grammar=True)`), until the running step's tokens are read
and accepted by the grammars, which then fill the bitmask while the forward still runs. A
request whose running token is its last (max_tokens, the model length) is left out; one that
stops on that token (EOS, a stop string) is found only afterwards, and its lookahead token is
dropped.
"""

from __future__ import annotations

from .outputs import OutputProcessor
from .request import RequestOutput
from .runner import Launched, ModelRunner
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from .step import PlainStep


class LookaheadStep(PlainStep):
    """Asynchronous scheduling (vLLM's async scheduling, for decodes). Each call:
      1. the step to finish: the one launched last time, else a normally scheduled one,
         launched and committed now (its input tokens are on the host);
      2. the next step launched at once when it can be a plain continuation, its decodes'
         input tokens copied on the device from (1)'s samples (`lookahead`);
      3. (1)'s tokens read (the only wait for the device, now with (2) queued behind it),
         appended and checked for stops; then (2) is committed, its input tokens now known.
    A request that stopped in (1) wastes its slot in (2), whose token for it is dropped."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor, *, max_model_len: int):
        super().__init__(scheduler, runner, outputs)
        self.max_model_len = max_model_len
        self.pending: Launched | None = None      # the launched step whose tokens the host has not read
        self.num_lookahead_steps = 0

    @property
    def in_flight(self) -> bool:
        return self.pending is not None

    def step(self) -> list[RequestOutput]:
        launched = self.pending
        if launched is None:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            launched = self.launch(out)
            self.scheduler.commit(out)
        following = self.lookahead(launched)
        if following is not None:
            self.num_lookahead_steps += 1
        outputs = self.collect(launched)
        if following is not None:
            self.runner.finish_sampling(following)   # its grammars have seen `launched`'s tokens now
            self.scheduler.commit(SchedulerOutput(scheduled=[s for s in following.out.scheduled
                                                             if not s.request.finished]))
        self.pending = following
        return outputs

    def _continues(self, s: ScheduledRequest) -> bool:
        """Whether the request's next decode can be launched before its running token is known
        (the host holds every token before that one: the step before the running one was
        collected)."""
        r, p = s.request, s.request.params
        after = len(r.output_token_ids) + 1              # outputs once the running token is appended
        if (r.finished or s.spec_tokens or p.uses_penalties or p.allowed_tokens or p.min_tokens > after):
            return False
        if p.max_tokens is not None and after >= p.max_tokens:
            return False                                 # the running token is its last
        if r.num_tokens + 1 >= self.max_model_len:
            return False                                 # likewise, at the model length
        start = r.num_computed_tokens                    # committed through the running step
        return not any(start < pos <= start + 1 for pos in r.checkpoint_targets)

    def lookahead(self, running: Launched) -> Launched | None:
        """Launch the decode step that follows `running` (committed already) or return None
        when it cannot be a plain continuation; `step` commits it once `running`'s tokens are
        appended."""
        if running.samples is None or self.scheduler.waiting or len(running.rows) != len(running.out.scheduled):
            return None
        chosen, sources = [], []
        for j, row in enumerate(running.rows):
            s = running.out.scheduled[row]
            if not self._continues(s):
                continue
            if not self.scheduler.grow_for_lookahead(s.request):
                return None                              # short of rows: the scheduler decides (preemption)
            chosen.append(ScheduledRequest(s.request, 1, lookahead=True))
            sources.append(j)
        if not chosen:
            return None
        return self.launch(SchedulerOutput(scheduled=chosen), previous_tokens=(running.samples.tokens, sources),
                           defer_grammar=True)
