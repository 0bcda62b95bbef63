"""DSA indexer decode scores read from the quantised index-key pages in torch, without host
synchronisation: what the reference platform serves as `indexer.paged_decode_scores`.
`k3.plugin.kernels.IndexerPagedDecodeScores` is the contract; `k3.reference.indexer_paged_decode_scores`,
one sequence's positions at a time, is its oracle. Every sequence's pages are gathered through
the block table, dequantised in the compute dtype and scored padded and masked.
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype


def indexer_paged_decode_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_values: torch.Tensor,
    key_scales: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    fmt: str,
    quantize_query: bool = True,
) -> torch.Tensor:
    """`IndexerPagedDecodeScores`, batched: the module docstring."""
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"indexer_paged_decode_scores: fmt must be one of ('fp8', 'mxfp4'), got {fmt!r}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or key_values.dim() != 3:
        raise ValueError(
            f"indexer_paged_decode_scores: block_table must be [N, max_pages] with N = {q.shape[0]} and "
            f"key_values [P, page, ...]; got {tuple(block_table.shape)}, {tuple(key_values.shape)}"
        )
    n, pages = block_table.shape
    page, d = key_values.shape[1], q.shape[-1]
    rows = block_table.long()
    # fp8 pages gathered as bytes: torch 2.9's CPU cannot index float8 tensors (the torch-xla venv)
    values = key_values.view(torch.uint8)[rows].view(key_values.dtype) if key_values.device.type == "cpu" \
        and key_values.is_floating_point() and key_values.element_size() == 1 else key_values[rows]
    values = values.reshape(n * pages * page, -1)
    scales = key_scales[rows].reshape(n * pages * page, *key_scales.shape[2:])
    keys = ref.indexer_dequantize_keys(values, scales, fmt=fmt, dtype=compute_dtype(q, head_weights))
    return ref.indexer_decode_scores(q, head_weights, keys.view(n, pages * page, d), seq_lens,
                                     quantize_query=quantize_query)
