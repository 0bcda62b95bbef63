"""Drawing draft tokens from a proposer's logits: the argmax ("greedy") or a sample from the
request's own sampling transform of the draft distribution ("probabilistic"), whose
distribution q the rejection rule then needs (`k3.engine.spec.rejection`)."""

from __future__ import annotations

import torch

from k3.engine.sampler import uniform_noise

from .rejection import target_probs


def draw_drafts(logits: torch.Tensor, requests, step: int, *, greedy: bool,
                stream: int) -> tuple[list[int], torch.Tensor | None]:
    """logits [N, V], one row per request -> (the N draft tokens, their distributions q [N, V]
    or None when greedy). step: the draft's index in this proposal (0 = the first); the noise
    is keyed by (request seed ^ stream, output position + step), so a proposer's draws do not
    depend on its batch."""
    if greedy:
        return logits.argmax(-1).tolist(), None
    probs = torch.stack([target_probs(row[None], r.params)[0] for row, r in zip(logits, requests)])
    seeds = torch.tensor([r.seed ^ stream for r in requests])
    steps = torch.tensor([len(r.output_token_ids) + step for r in requests])
    race = -torch.log(uniform_noise(seeds, steps, probs.shape[1]))
    return (probs / race.to(probs.device)).argmax(-1).tolist(), probs
