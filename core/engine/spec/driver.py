"""The speculative step strategy: propose, verify in one target pass, accept exactly, commit
the KDA state at the accepted length. Proposers: n-gram, a draft model, a DSpark draft, the
checkpoint's MTP layer.

Per step: every running request in its decode phase gets up to k drafts from the proposer;
the scheduler verifies them as 1 + k tokens in the same forward as everyone else (requests
without drafts decode one token); acceptance uses the request's own sampling transform; the
KDA rows are committed at the accepted length before anything else runs (a row copy with the
"states" rollback, a closed-form rebuild with "recover"). Attention pages need nothing: the
rejected positions are past the sequence length and are overwritten later.

Structured-output requests speculate too (`k3.structured.speculation`, as vLLM): their
drafts are cut at the first token the grammar refuses (a probabilistic draft keeps that token
as its last: the verify pass rejects it with certainty and draws from the residual, which the
standard rule needs to stay exact; for a one-hot draft the two are the same, so it is
dropped); while the verify forward runs the host fills the bitmask rows of the 1 + k
positions (the grammar after each draft prefix, then rolled back), and acceptance reads the
logits masked by them. The grammar then follows only the kept tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from k3.cache.block_pool import BlockPool
from k3.structured.bitmask import unpack_bitmask
from k3.structured.speculation import fill_draft_rows, grammar_valid_drafts

from ..outputs import OutputProcessor
from ..request import RequestOutput
from ..runner import ModelRunner
from ..scheduler import Scheduler, SchedulerOutput
from ..step import PlainStep
from .config import SpeculativeConfig, SpeculativeConfigError
from .ngram import NgramProposer
from .rejection import verify


@dataclass
class SpecStats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # position i: times draft i was accepted
    proposed_per_position: list[int] = field(default_factory=list)
    grammar_refused_drafts: int = 0      # drafted tokens cut off because the grammar refused them (or a token before)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verify step (accepted drafts + the one sampled token)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        return {"spec_verify_steps_total": self.verify_steps, "spec_draft_tokens_total": self.draft_tokens,
                "spec_accepted_tokens_total": self.accepted_tokens,
                "spec_grammar_refused_drafts_total": self.grammar_refused_drafts,
                "spec_mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "spec_acceptance_per_position": [a / p if p else 0.0 for a, p in
                                                 zip(self.accepted_per_position, self.proposed_per_position)]}


def build_proposer(config: SpeculativeConfig, *, target, platform, cache_format, max_model_len: int,
                   max_num_seqs: int, model_dir=None, token_rows: int | None = None):
    """The proposer `config.method` names, for the target model `target` (n-gram, a draft
    model with its own cache in the target's record formats, a DSpark draft that reads the
    target's tapped layers: `proposer.tap_layers`, or the target checkpoint's own MTP layer).
    model_dir: the target checkpoint (the MTP layer's default source); token_rows: the target
    cache's token rows (the MTP cache holds as many pages, plus room for each request's drafts)."""
    if target.parallel.world_size > 1:
        raise SpeculativeConfigError("speculative decoding with tensor parallel size > 1 is not implemented yet "
                                     "(the KDA commit is not broadcast to worker ranks)")
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from .draft_model import DraftModelProposer

        return DraftModelProposer(config, target=target, platform=platform, cache_format=cache_format,
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if config.method == "mtp":
        from .mtp import MTPProposer

        rows = token_rows if token_rows is not None else max_num_seqs * -(-max_model_len // cache_format.block_size)
        rows += max_num_seqs * (1 + -(-k // cache_format.block_size))
        return MTPProposer(config, target=target, platform=platform, cache_format=cache_format, model_dir=model_dir,
                           num_rows=rows)
    from .dspark import DSparkProposer

    return DSparkProposer(config, target=target, max_model_len=max_model_len, max_num_seqs=max_num_seqs)


def cut_at_grammar(grammar, tokens: list[int], probs: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
    """A constrained request's drafts cut at the first one its grammar refuses. One-hot drafts
    (probs None) end before it. A sampled draft keeps it as its last: the verify pass rejects
    it for certain (the masked target gives it probability 0) and draws the next token from the
    residual max(0, p - q), which the standard rule needs to keep the output distributed as p;
    drawing from p instead would over-weight the tokens q favours."""
    keep = grammar_valid_drafts(grammar, tokens)
    if probs is not None and keep < len(tokens):
        keep += 1
    return tokens[:keep], None if probs is None else probs[:keep]


class SpeculativeStep(PlainStep):
    """The step strategy of speculative decoding (see the module docstring).

    scratch: the BlockPool of the "states" rollback's scratch rows (`CachePlan.spec_rows`;
    None with "recover" or without KDA layers)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor, *,
                 config: SpeculativeConfig, proposer, scratch: BlockPool | None, max_model_len: int):
        super().__init__(scheduler, runner, outputs)
        self.config, self.proposer, self.scratch, self.max_model_len = config, proposer, scratch, max_model_len
        k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * k, proposed_per_position=[0] * k)
        self.pending: dict[str, object] = {}       # proposed this step, by request id
        self.kept: dict[str, int] = {}             # the last step's kept tokens per verifying request

    def step(self) -> list[RequestOutput]:
        """Propose for the running requests, then one forward that verifies their drafts beside
        every other request's tokens; accept, commit the KDA states, append."""
        self.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        self.prepare(out)
        launched = self.runner.run(out, defer_grammar=True)
        masks = self.grammar_masks(out)           # host fills while the forward runs
        self.runner.finish_sampling(launched)
        self.outputs.append_prompt_logprobs(out, launched.prompt_logprobs)
        starts = [s.request.num_computed_tokens for s in out.scheduled]
        verified = self.accept(out, launched.spec_logits, masks)
        self.scheduler.commit(out, self.kept if verified else None)
        if launched.taps is not None:        # a DSpark or MTP draft reads the computed tokens' features
            for i, s in enumerate(out.scheduled):
                kept = s.request.num_computed_tokens - starts[i]
                first = launched.token_starts[i]
                self.proposer.observe(s.request, starts[i], launched.taps[first:first + kept])
        touched = set()
        now = time.monotonic()
        for request_id, (tokens, logprobs) in verified.items():
            request = self.outputs.requests[request_id]
            for token, logprob in zip(tokens, logprobs):
                if request.finished:
                    break
                self.outputs.append(request, token, logprob, None, now)
            touched.add(request_id)
        if launched.samples is not None:
            self.outputs.append_samples(out, launched.rows, launched.samples, now, touched)
        return self.outputs.collect(touched)

    def spec_stats(self) -> dict:
        return self.stats.to_dict()

    # ------------------------------------------------------------------ propose
    @staticmethod
    def eligible(request) -> bool:
        """Speculation keeps the output distribution only where acceptance sees the same
        transform as sampling: no penalties, logit bias, token masks, logprobs or pending
        min_tokens. A structured-output grammar is part of that transform (its drafts are
        checked against it, and the verify pass masks every position with it)."""
        p = request.params
        return (request.num_computed_tokens == request.num_tokens - 1 and not p.uses_penalties and not p.logit_bias
                and p.allowed_tokens is None and p.logprobs is None and p.min_tokens <= len(request.output_token_ids))

    def propose(self, running: list) -> None:
        batch = []
        for request in running:
            request.spec_tokens, request.spec_probs = [], None
            if not self.eligible(request):
                continue
            left = request.params.max_tokens - len(request.output_token_ids) if request.params.max_tokens else 1 << 30
            limit = min(left - 1, self.max_model_len - request.num_tokens - 1, self.config.num_speculative_tokens)
            if limit > 0:
                batch.append((request, limit))
        self.pending = {}
        for (request, _), proposal in zip(batch, self.proposer.propose_batch(batch)):
            tokens, probs = proposal.tokens, proposal.probs
            if tokens and request.grammar is not None:
                tokens, probs = cut_at_grammar(request.grammar, tokens, probs)
                self.stats.grammar_refused_drafts += len(proposal.tokens) - len(tokens)
            if tokens:
                request.spec_tokens, request.spec_probs = tokens, probs
            if proposal.tokens:                # proposed (the proposer rolls back what is not verified)
                self.pending[request.request_id] = request

    # ------------------------------------------------------------------ verify
    def prepare(self, out: SchedulerOutput) -> None:
        """Rows ("states") or record slots ("recover") for this step's verifying requests."""
        slot = 0
        for s in out.scheduled:
            r = s.request
            if not s.spec_tokens:
                continue
            if self.config.kda_rollback == "states":
                # rows reserved up front: max_num_seqs x (1 + k), so a running request always has its own
                pool = self.scratch
                rows = pool.allocate(1 + len(s.spec_tokens)) if pool is not None else None
                if rows is None:       # a model without KDA layers needs no scratch rows
                    r.spec_tokens, r.spec_probs, s.num_new_tokens = [], None, 1
                    continue
                r.spec_rows = rows
            else:
                r.record_slot = slot
                slot += 1

    def grammar_masks(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        """{row of out.scheduled: allowed [1 + k, V] bool on the device} for the verifying
        requests with a grammar: position j allows what the grammar allows after the first j
        drafts (one host fill for the step, one upload, unpacked on the device)."""
        rows = [i for i, s in enumerate(out.scheduled) if s.spec_tokens and s.request.grammar is not None]
        if not rows:
            return {}
        drafts = [out.scheduled[i].spec_tokens for i in rows]
        first = [0]
        for d in drafts:
            first.append(first[-1] + 1 + len(d))
        host = self.runner.host_bitmask(first[-1])
        fill_draft_rows([out.scheduled[i].request.grammar for i in rows], drafts, host, first[:-1])
        allowed = unpack_bitmask(self.runner.upload_bitmask(host), self.runner.vocab_size)
        return {i: allowed[first[j]:first[j + 1]] for j, i in enumerate(rows)}

    def accept(self, out: SchedulerOutput, spec_logits: dict[int, torch.Tensor],
               masks: dict[int, torch.Tensor] | None = None) -> dict[str, tuple[list[int], list[float]]]:
        """Verify every verifying request (its logits masked by `masks`, `grammar_masks`),
        commit its KDA rows; returns request id -> (tokens to append, their raw logprobs). Also
        fills `self.kept` for the scheduler's commit."""
        masks = masks or {}
        self.kept = {}
        pending, self.pending = self.pending, {}
        results, copies, freed = {}, [], []
        rec_slots, rec_rows, rec_kept = [], [], []
        for i, logits in spec_logits.items():
            s = out.scheduled[i]
            r = s.request
            drafts = s.spec_tokens
            target = logits.float()
            if i in masks:
                target = target.masked_fill(~masks[i], float("-inf"))
            n_acc, token = verify(target, drafts, r.spec_probs, r.params, seed=r.seed, step=len(r.output_token_ids))
            kept = 1 + n_acc
            self.kept[r.request_id] = kept
            if self.config.kda_rollback == "states":
                copies.append((r.spec_rows[kept - 1], r.state_row))
                freed += r.spec_rows
                r.spec_rows = []
            else:
                rec_slots.append(r.record_slot)
                rec_rows.append(r.state_row)
                rec_kept.append(kept)
                r.record_slot = None
            pending.pop(r.request_id, None)
            tokens = drafts[:n_acc] + [token]
            logprobs = torch.log_softmax(logits[: len(tokens)].float(), -1)
            results[r.request_id] = (tokens, [float(logprobs[j, t]) for j, t in enumerate(tokens)])
            self.proposer.accepted(r, n_acc)
            st = self.stats
            st.verify_steps += 1
            st.draft_tokens += len(drafts)
            st.accepted_tokens += n_acc
            for j in range(len(drafts)):
                st.proposed_per_position[j] += 1
                st.accepted_per_position[j] += j < n_acc
            r.spec_tokens, r.spec_probs = [], None
        for request in pending.values():        # proposed, but not verified this step
            self.proposer.accepted(request, 0)
            request.spec_tokens, request.spec_probs = [], None
        if copies:
            self.runner.commit_kda(row_copies=copies)
            self.scratch.free(freed)
        if rec_rows:
            device = self.runner.device
            records = tuple(torch.tensor(v, device=device) for v in (rec_slots, rec_rows, rec_kept))
            self.runner.commit_kda(records=records)
        return results
