"""Decode-side bookkeeping the MLA decode kernels share (torch, on the device, no host sync):
which sequence and position each query token has, and a DSA selection cleaned for a kernel
(sorted, duplicates and out-of-range entries as -1: the reference selects a position once)."""

from __future__ import annotations

import torch


def query_positions(t: int, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None):
    """(seq_of [T] long: each query token's sequence, q_pos [T] long: its position) for T query
    tokens: one token per sequence (its last position) without cu_seqlens_q, else each
    sequence's last q_len tokens (speculative verify)."""
    n = seq_lens.shape[0]
    lens = seq_lens.long()
    if cu_seqlens_q is None:
        return torch.arange(n, device=seq_lens.device), lens - 1
    cu = cu_seqlens_q.long()
    tok = torch.arange(t, device=seq_lens.device)
    seq_of = (cu[1:][None, :] <= tok[:, None]).sum(-1).clamp(max=n - 1)
    return seq_of, lens[seq_of] - (cu[seq_of + 1] - tok)


def unique_selection(topk_indices: torch.Tensor, max_kv: int) -> torch.Tensor:
    """int32 [T, k]: topk_indices sorted per row, repeats, negatives and entries >= max_kv as -1."""
    ordered = topk_indices.long().sort(-1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    return torch.where(repeated | (ordered < 0) | (ordered >= max_kv), -1, ordered).to(torch.int32)
