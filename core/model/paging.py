"""Address arithmetic for the paged latent / index-key cache views."""

from __future__ import annotations

import torch

from k3.model.metadata import ForwardMetadata


def token_page_slots(meta: ForwardMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page [T], offset [T]) where each new token's cache row lives (from the slot mapping)."""
    return meta.slot_mapping // page_size, meta.slot_mapping % page_size


def gather_sequences(cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cached rows, packed: ([sum(seq_lens), *row], cu_seqlens [N+1] int32).

    cache [P, page_size, *row]; block_table [N, max_pages]; seq_lens [N]. Reads seq_lens on
    the host (prefill path).
    """
    page_size = cache.shape[1]
    lens = seq_lens.tolist()
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cache.device), seq_lens.to(cache.device))
    pos = torch.cat([torch.arange(n, device=cache.device) for n in lens]) if lens else seq
    pages = block_table[seq, pos // page_size].long()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=cache.device)
    cu[1:] = seq_lens.to(cache.device).cumsum(0)
    if cache.device.type == "cpu" and cache.element_size() == 1 and cache.is_floating_point():     # fp8 rows gathered as bytes: torch 2.9's
        return cache.view(torch.uint8)[pages, pos % page_size].view(cache.dtype), cu   # CPU cannot index float8
    return cache[pages, pos % page_size], cu


def bounded_pages(pages: torch.Tensor, block_table: torch.Tensor,
                  bound: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, block_table) a decode reads when no sequence is longer than `bound` tokens
    (`ForwardMetadata.context_bound`): the table cut to the pages that hold `bound` positions
    and, when those fit in one page, every page cut to its first `bound` slots (a strided view,
    no copy: position p < bound stays at page 0, slot p). A kernel that gathers and masks the
    whole table then reads `bound` positions a sequence instead of max_pages * page_size.

    pages [P, page_size, *row]; block_table [N, max_pages]. bound None: both unchanged.
    """
    if bound is None:
        return pages, block_table
    page_size = pages.shape[1]
    used = max(1, -(-bound // page_size))
    if used == 1 and bound < page_size:
        pages = pages[:, :bound]
    return pages, block_table[:, :used]
