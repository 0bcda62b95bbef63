"""Token-sharded prefill inside the engine's steps (`--token-sharded-prefill-min-tokens`).

Under tensor parallelism a long prompt's prefill runs through `k3.model.token_sharded.
TokenShardedPrefill` over the TP group (the TP variant: every rank runs the TP prefill of the
whole prompt, and each MLA layer's attention is re-laid out from heads to tokens, rank r taking
pieces r and 15 - r of 16) instead of every rank attending with all of the prompt's queries.
The scheduler gives such a prompt a step of its own (`Scheduler`'s token-sharded rule); every
rank's `ModelRunner.forward` sees the same metadata and takes this path when `covers` says so,
so the TP leader sends nothing more than the step it always broadcasts. The cache rows and the
sampled token equal the plain TP prefill's (docs/token-sharded-prefill.md, "In the engine").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.metadata import ForwardMetadata
from k3.model.token_sharded import TokenShardedPrefill


@dataclass
class ShardedStepResult:
    """What `ModelRunner.forward` returns for a token-sharded step: the last token's logits [1, V]."""

    logits: torch.Tensor
    taps: dict | None = None


class ShardedPrefillStep:
    """The token-sharded prefill of one TP rank's runner.

    model: the rank's model, sharded over its TP group (size 2, 4 or 8: the piece rule needs a
        world dividing 8); min_tokens: the shortest prompt chunk that runs token-sharded;
    page_size: the cache's block size. `prefills` counts the steps that took this path."""

    def __init__(self, model, *, min_tokens: int, page_size: int):
        if min_tokens < 1:
            raise ValueError(f"token-sharded prefill needs min_tokens >= 1, got {min_tokens}")
        par = model.parallel
        self.prefill = TokenShardedPrefill(model, rank=par.rank, world=par.world_size, collectives=par.collectives)
        self.min_tokens, self.page_size = min_tokens, page_size
        self.prefills = 0

    def covers(self, meta: ForwardMetadata) -> bool:
        """The step is one fresh prompt chunk (no cached context, no KDA checkpoints) of at
        least min_tokens tokens that samples from its last token only. The same answer on every
        rank: it reads only the broadcast metadata."""
        if meta.num_tokens < self.min_tokens or meta.cu_seqlens.numel() != 2 or meta.checkpoints is not None:
            return False
        if meta.logits_indices.numel() != 1:
            return False
        return int(meta.context_lens[0]) == 0 and int(meta.logits_indices[0]) == meta.num_tokens - 1

    def run(self, meta: ForwardMetadata, cache) -> ShardedStepResult:
        """Prefill the step's prompt chunk into `cache` (the sequence's pages and state row)."""
        out = self.prefill.prefill(meta.input_ids.tolist(), cache, block_row=meta.block_table[0],
                                   state_row=int(meta.state_indices[0]), page_size=self.page_size)
        self.prefills += 1
        return ShardedStepResult(out.logits)
