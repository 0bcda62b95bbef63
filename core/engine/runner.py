"""Run a scheduled step on one rank's model and cache, and sample (rank 0).

Every forward reads the cache only through `ForwardMetadata` (slot mapping, block table and
state indices as tensors built from the requests' row lists, `k3.engine.batch`) and
`CacheViews`; no per-request Python object reaches the model. Nothing here waits for the
device: a launched step's samples and scores are device tensors until a strategy reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.model.metadata import ForwardMetadata
from k3.structured.bitmask import bitmask_width
from k3.structured.request_state import fill_rows

from .batch import build_metadata, build_sampling
from .prompt_logprobs import PromptScores, score_prompt_rows
from .sampler import SamplerOutput, SamplingBatch, sample_batch
from .scheduler import SchedulerOutput


@dataclass
class ReplayedStep:
    """What a replayed decode graph gives back: the logits [N, V] only."""

    logits: torch.Tensor
    taps: dict | None = None


@dataclass
class Launched:
    """A step running on the device (device tensors, not read yet): what was scheduled, the
    rows of `out.scheduled` that sample and their samples, the scored prompt positions,
    {row: logits [1 + k, V]} of the verifying requests, the tapped features [T, n * d] of a
    DSpark draft's layers and the first packed token of each scheduled request."""

    out: SchedulerOutput
    rows: list[int]
    samples: SamplerOutput | None
    prompt_logprobs: PromptScores | None = None
    spec_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    taps: torch.Tensor | None = None
    token_starts: list[int] = field(default_factory=list)
    # (logits, SamplingBatch) of a step whose sampling waits for its grammars' bitmask
    # (`ModelRunner.run(defer_grammar=True)`, then `finish_sampling`)
    deferred: tuple | None = None


class ModelRunner:
    """Runs scheduled steps on one rank's model and cache.

    eos_token_ids: what a request under min_tokens may not sample yet.
    tap_layers: target layers whose features a DSpark or MTP draft reads (`Launched.taps`;
        `k3.model.model.FINAL_HIDDEN`: the final hidden state).
    graphs: DecodeGraphs replaying plain decode steps (None: eager).
    pinned_uploads: stage uploads in page-locked memory (asynchronous scheduling).
    broadcast: called with each step's metadata and row copies before the forward (rank 0
        of tensor parallelism: the other ranks follow), and with its image rows when it has any.
    batch_invariant: the batch-invariant mode (docs/batch-invariance.md): the model was built on
        the platform's batch-invariant kernels (`KernelSet.batch_invariant`), so a step is one
        plain forward; image requests are refused in it.
    media: the MediaEncoder of a model with a vision tower (None: text only): before a step's
        forward it encodes the images the step's chunks reach, and the forward takes their rows.
    padding: a `StepPadding` (the platform's `k3_shape_buckets`): every step is padded to its
        buckets on the host and sampled at the batch bucket; None: steps run at their own shapes.
    step_end: called after every forward (the platform's `k3_step_end`: a lazy backend cuts its
        trace there, so a step is one graph), or None.
    sharded_prefill: a `ShardedPrefillStep` (tensor parallelism with
        --token-sharded-prefill-min-tokens): a step it covers (one long fresh prompt chunk) runs
        token-sharded over the TP group instead of the plain forward; None: never.
    """

    def __init__(self, model, cache, *, block_size: int, vocab_size: int, device, eos_token_ids=(),
                 tap_layers: tuple[int, ...] = (), graphs=None, pinned_uploads: bool = False,
                 broadcast: Callable | None = None, batch_invariant: bool = False, media=None,
                 sharded_prefill=None, padding=None, step_end: Callable | None = None):
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.vocab_size = vocab_size                # the logits' width
        self.stop_token_ids = set(eos_token_ids)
        self.tap_layers, self.graphs = tuple(tap_layers), graphs
        self.pinned_uploads, self.broadcast, self.media = pinned_uploads, broadcast, media
        self.batch_invariant, self.sharded_prefill = batch_invariant, sharded_prefill
        self.padding = padding                      # StepPadding: static-shape buckets (k3_shape_buckets), or None
        self.step_end = step_end                    # k3_step_end: called after each forward, or None
        self.num_forwards = 0                       # forwards run (expert parallelism keeps DP ranks in lockstep by it)

    def forward(self, meta: ForwardMetadata, row_copies: list[tuple[int, int]] = (),
                media: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Copy rows (prefix-cache hits: checkpoints into private state rows, partly shared
        blocks), then run the model (a plain decode step replays its captured graph).
        media: (image embedding rows, the batch rows they replace) of the step, or None."""
        self.num_forwards += 1
        for src, dst in row_copies:
            self.cache.copy_row(src, dst)
        result = self._forward(meta, media)
        if self.step_end is not None:
            self.step_end()
        return result

    def _forward(self, meta: ForwardMetadata, media):
        if media is not None:
            return self.model(meta, self.cache.views, media_embeds=media[0], media_positions=media[1],
                              tap_layers=self.tap_layers)
        if self.sharded_prefill is not None and self.sharded_prefill.covers(meta):
            return self.sharded_prefill.run(meta, self.cache.views)
        if self.graphs is not None and not self.tap_layers and self.graphs.covers(meta):
            return ReplayedStep(self.graphs.run(meta))
        return self.model(meta, self.cache.views, tap_layers=self.tap_layers)

    def run(self, out: SchedulerOutput, *, previous_tokens: tuple[torch.Tensor, list[int]] | None = None,
            defer_grammar: bool = False) -> Launched:
        """Forward the step and sample, without waiting for the device.

        previous_tokens: (the previous step's sampled tokens [M] on the device, the row of them
            each scheduled request takes as its input token): a step of lookahead decodes.
        defer_grammar: when a sampling row has a structured-output grammar, launch the forward
            only; `finish_sampling` fills the bitmask and samples once the grammars have seen
            the previous step's tokens (a lookahead step is launched before they are read).
        """
        sources = None if previous_tokens is None else previous_tokens[1]
        step = build_metadata(out, block_size=self.block_size, device=self.device, pinned=self.pinned_uploads,
                              token_sources=sources, padding=self.padding)
        if previous_tokens is not None:     # the placeholders become the previous step's tokens, on the device
            step.meta.input_ids.copy_(previous_tokens[0].index_select(0, step.token_sources))
        # Everything the sampler reads is on the device before the forward is launched: a host
        # to device copy after it (from pageable memory) would wait for the whole forward, and the
        # sampler's launches would then run with the GPU idle instead of behind the forward.
        sampling = None
        if step.sample_rows:
            # a padded step samples at its batch bucket: the padding rows repeat the last request's
            # parameters and their samples are dropped (`launched.rows` holds the real rows only)
            rows = step.sample_rows + [step.sample_rows[-1]] * (len(step.sample_logits) - len(step.sample_rows))
            sampling = build_sampling(out, rows, vocab_size=self.vocab_size, device=self.device,
                                      pinned=self.pinned_uploads)
            sampling.batch_invariant = self.batch_invariant
            self._block_stop_ids(sampling, [self._not_yet(out.scheduled[i]) for i in rows])
        media = None
        if self.media is not None:
            self.media.encode_step(out.scheduled)
            media = self.media.step_embeds(out.scheduled, step.token_starts)
        if self.broadcast is not None:
            if media is None:
                self.broadcast(step.meta, out.row_copies)
            else:
                self.broadcast(step.meta, out.row_copies, media=media)
        result = (self.forward(step.meta, out.row_copies) if media is None
                  else self.forward(step.meta, out.row_copies, media))
        logits = result.logits
        launched = Launched(out, step.sample_rows, None, token_starts=step.token_starts,
                            spec_logits={i: logits[rows] for i, rows in step.spec_rows.items()})
        if self.tap_layers:
            launched.taps = torch.cat([result.taps[layer] for layer in self.tap_layers], -1)
        if step.prompt_spans:
            top_n = max(out.scheduled[i].request.params.prompt_logprobs for i in step.prompt_spans)
            launched.prompt_logprobs = score_prompt_rows(logits, step.prompt_spans, step.prompt_targets, top_n,
                                                         batch_invariant=self.batch_invariant)
        if sampling is None:
            launched.rows = []
            return launched
        if logits.shape[1] != self.vocab_size:
            raise RuntimeError(f"the model returned logits of width {logits.shape[1]}, expected the vocabulary "
                               f"size {self.vocab_size}")
        logits = logits[step.sample_index] if step.sample_index is not None else logits[: len(step.sample_logits)]
        launched.deferred = (logits, sampling)
        if not (defer_grammar and any(out.scheduled[i].request.grammar is not None for i in step.sample_rows)):
            self.finish_sampling(launched)
        return launched

    def finish_sampling(self, launched: Launched) -> None:
        """Sample a step launched with its sampling deferred (nothing to do otherwise). The
        grammars fill their bitmask now, while the forward runs on the device; the upload is
        queued behind it without a host wait (pinned memory off the CPU)."""
        if launched.deferred is None:
            return
        (logits, sampling), launched.deferred = launched.deferred, None
        grammars = [launched.out.scheduled[i].request.grammar for i in launched.rows]
        grammars += [None] * (logits.shape[0] - len(grammars))     # a padded step's padding rows
        sampling.bitmask = self._grammar_bitmask(grammars)
        launched.samples = sample_batch(logits, sampling)

    def _grammar_bitmask(self, grammars: list) -> torch.Tensor | None:
        """The structured-output bitmask [B, W] int32 on the device of the sampling rows, or
        None when no row is constrained this step (rows without a grammar allow everything)."""
        if not any(g is not None and g.active for g in grammars):
            return None
        host = self.host_bitmask(len(grammars))
        fill_rows(grammars, host, list(range(len(grammars))))
        return self.upload_bitmask(host)

    def host_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 CPU bitmask [rows, W] allowing every token, page-locked with pinned uploads."""
        return torch.full((rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32, pin_memory=self._pin_bitmask)

    def upload_bitmask(self, host: torch.Tensor) -> torch.Tensor:
        """`host_bitmask`'s tensor on the device (queued without a host wait when page-locked)."""
        return host.to(self.device, non_blocking=self._pin_bitmask)

    @property
    def _pin_bitmask(self) -> bool:
        return self.pinned_uploads and self.device.type != "cpu"

    def _not_yet(self, s) -> set[int]:
        """The token ids a scheduled request must not sample yet (min_tokens)."""
        return self.stop_token_ids if s.request.params.min_tokens > s.output_index else set()

    def _block_stop_ids(self, sampling: SamplingBatch, blocked: list[set[int]]) -> None:
        """Mask the token ids each row must not emit yet (min_tokens) into `sampling.allowed`."""
        if not any(blocked):
            return
        if sampling.allowed is None:
            sampling.allowed = torch.ones(len(blocked), self.vocab_size, dtype=torch.bool, device=self.device)
        for row, ids in enumerate(blocked):
            if ids:
                sampling.allowed[row, torch.tensor(sorted(ids), device=self.device)] = False

    def commit_kda(self, *, row_copies=(), records=None) -> None:
        """Commit verified KDA states: row copies ("states" rollback), or a rebuild from the
        records of (slots, rows, kept) ("recover")."""
        for src, dst in row_copies:
            self.cache.copy_row(src, dst)
        if records is not None:
            self.model.commit_speculation(self.cache.views, *records)
