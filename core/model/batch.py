"""Block tables for callers that drive the model directly (tests, conformance) over a small
`k3.cache.pool.CachePool`: offset the table past the rows they use as state rows."""

from __future__ import annotations

import torch


def contiguous_block_table(num_seqs: int, pages_per_seq: int, device=None) -> torch.Tensor:
    """Block table giving sequence n the pages [n * pages_per_seq, (n + 1) * pages_per_seq)."""
    return torch.arange(num_seqs * pages_per_seq, dtype=torch.int32, device=device).reshape(num_seqs, pages_per_seq)
