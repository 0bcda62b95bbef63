"""Packed token bitmasks: bit (v % 32) of word v // 32 of a row is 1 when token v is allowed
(xgrammar's layout, int32 words). The host fills them; the device unpacks them into the bool
`allowed` mask the sampler applies, so no per-token index list crosses to the device."""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` ids."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size] from an int32 bitmask [B, W] (on the bitmask's device, no host sync)."""
    ids = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(1, ids // 32)
    return ((words >> (ids % 32).to(words.dtype)) & 1).bool()
