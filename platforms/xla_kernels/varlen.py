"""Packed sequences on the device, for the tpu platform's prefill kernels: what the reference
reads on the host from `cu_seqlens` (`k3.ops_helpers.sequence_bounds`), computed as device
arithmetic over static shapes instead, so a kernel traces into one XLA graph per shape whatever
the lengths are (no `.tolist()`, no data-dependent shape, no `searchsorted`, which torch-xla 2.9
runs on the CPU).

Every function takes `cu_seqlens` `[N+1]` (int, on the device, non-decreasing, starting at 0)
and the packed length T; a token at or past `cu_seqlens[N]` belongs to no sequence (id N).
"""

from __future__ import annotations

import torch


def token_sequences(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq [T] int64, pos [T] int64): each packed token's sequence (N past the last one) and
    its position inside it (0 for those past the end)."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(T, device=cu.device)
    seq = (t[:, None] >= cu[None, 1:]).sum(1)                                  # [T] ends at or before t
    start = cu[:-1].gather(0, seq.clamp(max=cu.numel() - 2))
    pos = torch.where(seq < cu.numel() - 1, t - start, torch.zeros_like(t))
    return seq, pos


def lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] int64 the sequences' lengths."""
    cu = cu_seqlens.to(torch.long)
    return cu[1:] - cu[:-1]


def segment_mask(seq_q: torch.Tensor, seq_k: torch.Tensor) -> torch.Tensor:
    """[Tq, Tk] bool: query and key tokens of the same sequence (none for tokens past the end:
    their id is N on both sides, so callers also mask by `seq < N` where it matters)."""
    return seq_q[:, None] == seq_k[None, :]
