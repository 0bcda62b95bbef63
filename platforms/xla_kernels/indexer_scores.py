"""DSA indexer prefill scores for XLA: `IndexerKernels.scores` without the host read of
`cu_seqlens`.

`k3.plugin.kernels.IndexerScores` is the contract, `k3.reference.indexer_scores` its oracle.
Every query is scored against every packed key (one product, `[T, Hi, S]`), then the columns
are gathered by position: position p of the query's sequence is packed row
`cu_seqlens_kv[n] + p`, for every p < W (static), -inf where the varlen rule hides it.
W is `max_kv_len` when the caller passes it (a host int: the bucket); without it the contract's
width, the longest kv_len, is the one value read from the device.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import index_query

from . import varlen


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, *, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_kv: torch.Tensor, quantize_query: bool = True,
                   max_kv_len: int | None = None) -> torch.Tensor:
    """`IndexerScores` (the module docstring): weighted ReLU scores by position, masked."""
    op = "indexer_scores"
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: q must be [T, Hi, D] and keys [S, D]; got {tuple(q.shape)}, {tuple(keys.shape)}")
    T, Hi, D = q.shape
    if tuple(head_weights.shape) != (T, Hi):
        raise ValueError(f"{op}: head_weights must be [T={T}, Hi={Hi}]; got {tuple(head_weights.shape)}")
    S, N = keys.shape[0], cu_seqlens_q.shape[0] - 1
    kv_lens = varlen.lengths(cu_seqlens_kv)
    W = int(kv_lens.max()) if max_kv_len is None else int(max_kv_len)     # the contract's width (host int)
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    seq, i_q = varlen.token_sequences(cu_seqlens_q, T)
    n = seq.clamp(max=N - 1)
    kv_len = kv_lens.gather(0, n)                                             # [T]
    q_pos = kv_len - varlen.lengths(cu_seqlens_q).gather(0, n) + i_q          # [T]
    p = torch.arange(W, device=q.device)
    rows = (cu_seqlens_kv.long()[:-1].gather(0, n)[:, None] + p[None, :]).clamp(max=max(S - 1, 0))   # [T, W]
    kc = upcast(keys, cd)
    if S == 0:
        kc = kc.new_zeros(1, D)
    dots = torch.relu(torch.einsum("thd,sd->ths", qc, kc))                    # [T, Hi, S] every packed key
    acc = (w[:, :, None] * dots).sum(1).gather(1, rows)                       # [T, W] by position
    ok = (p[None, :] <= q_pos[:, None]) & (p[None, :] < kv_len[:, None]) & (seq < N)[:, None]
    return acc.masked_fill(~ok, float("-inf"))
