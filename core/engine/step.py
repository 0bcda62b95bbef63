"""The plain step strategy: schedule, run, commit, append the sampled tokens.

A step strategy is what `LLMEngine.step` calls. It owns the scheduler and runner
interactions of its kind of step and appends what the step produced to the engine's
OutputProcessor. The others build on this one: asynchronous lookahead (`k3.engine.lookahead`)
and speculative decoding (`k3.engine.spec.driver`).
"""

from __future__ import annotations

import time

from .outputs import OutputProcessor
from .request import RequestOutput
from .runner import Launched, ModelRunner
from .scheduler import Scheduler, SchedulerOutput


class PlainStep:
    """One scheduled forward per call, read back before the call returns."""

    num_lookahead_steps = 0         # decode steps launched ahead (asynchronous scheduling)

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor):
        self.scheduler, self.runner, self.outputs = scheduler, runner, outputs

    @property
    def in_flight(self) -> bool:
        """A launched step whose tokens the host has not read yet."""
        return False

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; the outputs of every request that progressed."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        launched = self.launch(out)
        self.scheduler.commit(out)
        return self.collect(launched)

    def launch(self, out: SchedulerOutput, previous_tokens=None, defer_grammar: bool = False) -> Launched:
        """Run a scheduled step on the device without waiting for it (defer_grammar:
        `ModelRunner.run`'s, for a step launched before the grammars saw the previous tokens)."""
        return self.runner.run(out, previous_tokens=previous_tokens, defer_grammar=defer_grammar)

    def collect(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's scores and tokens (waiting for the device) and append them."""
        self.outputs.append_prompt_logprobs(launched.out, launched.prompt_logprobs)
        if launched.samples is None:
            return []
        touched: set[str] = set()
        self.outputs.append_samples(launched.out, launched.rows, launched.samples, time.monotonic(), touched)
        return self.outputs.collect(touched)

    def spec_stats(self) -> dict:
        """Speculative decoding's counters (none here)."""
        return {}
