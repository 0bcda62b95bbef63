"""Exact verification of drafted tokens (Leviathan / Chen speculative sampling).

For drafts x_1..x_k with draft distributions q_i and target distributions p_i (the request's
own sampling transform: temperature, top-k, top-p, min-p), accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw from normalize(max(0, p_i - q_i));
if all are accepted draw the bonus token from p_{k+1}. Greedy requests accept while the draft
is the target's argmax. The output distribution is exactly p whatever q is. Randomness is
counter-based (seed, output index, token), like the non-speculative sampler.
"""

from __future__ import annotations

import torch

from k3.engine.sampler import uniform_noise
from k3.reference.sampling import sampling_probs

_ACCEPT_STREAM = 0x5EC5EC       # a second noise stream for the acceptance test


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """p [L, V] (float64) of a request's sampling transform over L positions."""
    temperature = max(params.temperature, 1e-30)
    return sampling_probs(logits.double(), temperature=temperature, top_k=params.top_k or None,
                          top_p=params.top_p, min_p=params.min_p)


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, params, *, seed: int,
           step: int) -> tuple[int, int]:
    """(accepted drafts, next token) for one request.

    logits [k+1, V]: the target's logits at the last known token and at each draft;
    draft_probs [k, V] or None (a greedy / n-gram proposal: one-hot q); step: the output index
    of the first drafted token (noise counter).
    """
    k = len(drafts)
    if params.temperature <= 0:
        best = logits.argmax(-1).tolist()
        n = 0
        while n < k and drafts[n] == best[n]:
            n += 1
        return n, best[n]
    p = target_probs(logits, params)                                          # [k+1, V]
    vocab = p.shape[1]
    seeds = torch.full((k + 1,), seed, dtype=torch.long)
    steps = torch.arange(step, step + k + 1, dtype=torch.long)
    r = uniform_noise(seeds ^ _ACCEPT_STREAM, steps, 1)[:, 0]                 # [k+1] acceptance draws
    race = -torch.log(uniform_noise(seeds, steps, vocab)).to(p.device)       # [k+1, V] exponential race
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x <= 0:
            raise ValueError(f"draft token {x} has draft probability 0: the proposal is not from q")
        if r[i] * q_x < p[i, x]:                                              # accept w.p. min(1, p/q)
            continue
        q = torch.zeros(vocab, dtype=torch.float64, device=p.device)      # on the target's device (GPU logits)
        if draft_probs is None:
            q[x] = 1.0
        else:
            q = draft_probs[i].to(p.device, torch.float64)
        residual = (p[i] - q).clamp_min(0)
        if residual.sum() <= 0:                                               # p == q: cannot happen after a reject
            residual = p[i]
        return i, int((residual / race[i]).argmax())
    return k, int((p[k] / race[k]).argmax())
