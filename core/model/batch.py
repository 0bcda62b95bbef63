"""Cache allocation helpers for tests and the single-request loop (the engine's planner
allocates packed rows instead; both hand the model the same `CacheViews`)."""

from __future__ import annotations

import torch


def contiguous_block_table(num_seqs: int, pages_per_seq: int, device=None) -> torch.Tensor:
    """Block table giving sequence n the pages [n * pages_per_seq, (n + 1) * pages_per_seq)."""
    return torch.arange(num_seqs * pages_per_seq, dtype=torch.int32, device=device).reshape(num_seqs, pages_per_seq)
