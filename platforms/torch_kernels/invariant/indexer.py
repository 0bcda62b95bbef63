"""Batch-invariant DSA indexer scores (`IndexerKernels`, `k3.plugin.kernels.indexer`): every
(query, key) score is computed on its own, the same in prefill and decode,

    I(t, s) = ordered_sum_h(w[t, h] * ReLU(ordered_sum_D(q[t, h] * k[s])))

(q rounded to fp8 per token and head first, `k3.ops_helpers.index_query`), then masked.
Keys are scored KEY_BLOCK positions at a time (memory only: no score sums over keys). The key
codecs, the Hadamard rotation and the stable-sort top-k of the reference platform are already
row by row and exact, and serve unchanged (`tables.invariant_tables`).
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import index_query, varlen_spans

from k3.ops_helpers import invariant as p


def _score_rows(qc: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """qc [T, Hi, D], w [T, Hi], keys [T, S, D] (each query's own rows) -> scores [T, S]."""
    out = []
    for start in range(0, keys.shape[1], p.KEY_BLOCK):
        block = keys[:, start: start + p.KEY_BLOCK]                                       # [T, KB, D]
        dots = p.ordered_dot(qc[:, :, None, :], block[:, None], -1)                       # [T, Hi, KB]
        out.append(p.ordered_sum(w[..., None] * torch.relu(dots), 1))                     # [T, KB]
    return torch.cat(out, 1) if out else keys.new_zeros(keys.shape[:2])


def scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
           cu_seqlens_kv: torch.Tensor, quantize_query: bool = True) -> torch.Tensor:
    """`IndexerScores`: [T, max_kv], -inf past each query's causal position."""
    op = "indexer_scores"
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: q must be [T, Hi, D] and keys [S, D]; got {tuple(q.shape)}, {tuple(keys.shape)}")
    t, hi, _ = q.shape
    if tuple(head_weights.shape) != (t, hi):
        raise ValueError(f"{op}: head_weights must be [T={t}, Hi={hi}]; got {tuple(head_weights.shape)}")
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=t, num_kv=keys.shape[0], op=op)
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    width = max((k1 - k0 for _, _, k0, k1 in spans), default=0)
    rows = keys.new_zeros(t, width, keys.shape[1], dtype=cd)
    q_pos = torch.zeros(t, dtype=torch.long, device=q.device)
    for q0, q1, k0, k1 in spans:
        rows[q0:q1, : k1 - k0] = upcast(keys[k0:k1], cd)
        q_pos[q0:q1] = torch.arange(k1 - k0 - (q1 - q0), k1 - k0, device=q.device)
    out = _score_rows(qc, w, rows)
    causal = torch.arange(width, device=q.device)[None, :] <= q_pos[:, None]
    return out.masked_fill(~causal, float("-inf"))


def decode_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, seq_lens: torch.Tensor, *,
                  quantize_query: bool = True) -> torch.Tensor:
    """`IndexerDecodeScores`: [N, L], -inf at positions >= seq_lens."""
    if q.dim() != 3 or keys.dim() != 3 or keys.shape[0] != q.shape[0] or keys.shape[2] != q.shape[2]:
        raise ValueError(f"indexer_decode_scores: q must be [N, Hi, D] and keys [N, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}")
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    out = _score_rows(qc, w, upcast(keys, cd))
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens.to(q.device)[:, None]
    return out.masked_fill(~valid, float("-inf"))


def paged_decode_scores(q: torch.Tensor, head_weights: torch.Tensor, key_values: torch.Tensor,
                        key_scales: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *, fmt: str,
                        quantize_query: bool = True) -> torch.Tensor:
    """`IndexerPagedDecodeScores`: every sequence's pages gathered and dequantised, `decode_scores`."""
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"indexer_paged_decode_scores: fmt must be one of ('fp8', 'mxfp4'), got {fmt!r}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or key_values.dim() != 3:
        raise ValueError(f"indexer_paged_decode_scores: block_table must be [N, max_pages] with N = {q.shape[0]} "
                         f"and key_values [P, page, ...]; got {tuple(block_table.shape)}, {tuple(key_values.shape)}")
    n, pages = block_table.shape
    page, d = key_values.shape[1], q.shape[-1]
    rows = block_table.long()
    values = key_values.view(torch.uint8)[rows].view(key_values.dtype).reshape(n * pages * page, -1)
    scales_ = key_scales[rows].reshape(n * pages * page, *key_scales.shape[2:])
    keys = ref.indexer_dequantize_keys(values, scales_, fmt=fmt, dtype=compute_dtype(q, head_weights))
    return decode_scores(q, head_weights, keys.view(n, pages * page, d), seq_lens, quantize_query=quantize_query)
