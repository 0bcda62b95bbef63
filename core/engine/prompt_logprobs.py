"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`), as vLLM reports them.

The logits at prompt position p are the model's distribution over prompt token p + 1. A
request that asks for prompt logprobs gets a logits row at every position of its prefill
chunks (`batch.build_metadata`), and the rows are scored here after the forward: the prompt
token's log-probability and rank, and the top-n tokens. Log-probabilities are taken in the
logits' dtype (fp32, fp64 for a float64 model). A prefill recomputed after preemption scores
its positions again; the engine keeps the first result of each position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Logprob, Request
from .sampler import log_normaliser


@dataclass(frozen=True)
class PromptSpan:
    """Logits rows [row, row + count) of one scheduled request score its prompt positions
    [position, position + count) (each scores the prompt token after it)."""

    row: int
    position: int
    count: int


@dataclass
class PromptScores:
    """One step's scored prompt positions, rows in span order (device tensors, not read yet)."""

    spans: dict[int, PromptSpan]          # index into out.scheduled -> its rows
    token_logprobs: torch.Tensor          # [M] the prompt token's log-probability
    ranks: torch.Tensor                   # [M] its rank (1 + tokens more likely)
    top_ids: torch.Tensor | None          # [M, n] or None (n = the step's largest prompt_logprobs)
    top_logprobs: torch.Tensor | None     # [M, n] or None


def score_prompt_rows(logits: torch.Tensor, spans: dict[int, PromptSpan], targets: torch.Tensor,
                      top_n: int, *, batch_invariant: bool = False) -> PromptScores:
    """Score the spans' rows of `logits` [R, V] (the step's logits rows) against `targets` [M],
    the prompt tokens they predict, in span order. batch_invariant: the mode's normaliser
    (`k3.engine.sampler.log_normaliser`)."""
    index = torch.cat([torch.arange(s.row, s.row + s.count) for s in spans.values()]).to(logits.device)
    rows = logits.index_select(0, index)
    x = rows if rows.dtype == torch.float64 else rows.float()
    # logit - logsumexp(logits), the sampler's arithmetic for a sampled token's log-prob
    # (`k3.engine.sampler.sample_batch`), so a token scored here equals, bit for bit, what it was
    # served with when the logits agree (the batch-invariant mode's decode-vs-prefill promise)
    lp = x - log_normaliser(x, batch_invariant=batch_invariant)[:, None]                      # [M, V]
    token_lp = lp.gather(1, targets[:, None])                                                 # [M, 1]
    ranks = (lp >= token_lp).sum(-1)                       # vLLM's rank: tokens at least as likely
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (None, None)
    return PromptScores(spans, token_lp[:, 0], ranks, top_ids, top_lp)


def append_prompt_logprobs(scores: PromptScores, requests: list[Request], decode) -> None:
    """Add the scored positions to each request's `prompt_logprobs` (requests[i] is
    out.scheduled[i]'s request; positions it already holds are skipped). decode(token id) -> its
    text, or None without a tokenizer."""
    token_lp, ranks = scores.token_logprobs.tolist(), scores.ranks.tolist()
    top_ids = scores.top_ids.tolist() if scores.top_ids is not None else None
    top_lp = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    at = 0
    for i, span in scores.spans.items():
        r = requests[i]
        n = r.params.prompt_logprobs
        for k in range(span.count):
            position, row = span.position + k, at + k
            if r.finished or position + 1 != len(r.prompt_logprobs):
                continue                 # recomputed after preemption, or the request is gone
            token = r.prompt_token_ids[position + 1]
            entry = {token: Logprob(token_lp[row], ranks[row], decode(token))}
            for rank, (t, v) in enumerate(zip(top_ids[row][:n], top_lp[row][:n]) if n else (), start=1):
                entry.setdefault(t, Logprob(v, rank, decode(t)))
            r.prompt_logprobs.append(entry)
        at += span.count
