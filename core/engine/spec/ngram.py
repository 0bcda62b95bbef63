"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None     # [k, V] draft distributions; None: deterministic (one-hot)


class NgramProposer:
    tap_layers = ()                 # it reads no target features

    def __init__(self, num_tokens: int, lookup_min: int = 1, lookup_max: int = 4):
        self.k, self.lo, self.hi = num_tokens, lookup_min, lookup_max

    def propose_batch(self, batch: list[tuple]) -> list[Proposal]:
        """For each (request, limit): up to `limit` tokens continuing its tokens (empty: no match)."""
        return [self.lookup(request.all_token_ids, limit) for request, limit in batch]

    def accepted(self, request, num_accepted: int) -> None:
        """Nothing to roll back: the proposer keeps no state."""

    def release(self, request) -> None:
        """Nothing kept per request."""

    def lookup(self, tokens: list[int], limit: int) -> Proposal:
        """Up to min(k, limit) tokens continuing `tokens` (empty when nothing matches)."""
        k = min(self.k, limit)
        if k <= 0:
            return Proposal([])
        for n in range(min(self.hi, len(tokens) - 1), self.lo - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):          # latest occurrence first
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n: start + n + k]
                    if follow:
                        return Proposal(follow)
        return Proposal([])
