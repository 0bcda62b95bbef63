"""DSA indexer prefill scores with every head in one product: `IndexerKernels.scores` (see
k3.reference.indexer_scores for the contract).

The reference loops over the heads, one [Tq, Skv] product each. Here a block of queries takes
all heads at once (relu(q k^T) as [Tq_block, Hi, Skv], weighted and summed over the heads), the
query blocks sized so that product stays under `BLOCK_ELEMENTS`; then the causal mask. Same
quantised query (`index_query`) and compute dtype as the reference.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import allowed_mask, index_query, varlen_spans
from k3 import reference as ref

BLOCK_ELEMENTS = 1 << 26      # elements of one block's [Tq, Hi, Skv] product (256 MiB in fp32)


def indexer_scores(q, head_weights, keys, *, cu_seqlens_q, cu_seqlens_kv, quantize_query=True):
    """`k3.reference.indexer_scores` with the heads batched (same signature and contract)."""
    if q.dim() != 3 or keys.dim() != 2 or head_weights.dim() != 2 or keys.shape[1] != q.shape[2] \
            or tuple(head_weights.shape) != tuple(q.shape[:2]):
        return ref.indexer_scores(q, head_weights, keys, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                                  quantize_query=quantize_query)       # raises the contract's error
    T, Hi, _ = q.shape
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=T, num_kv=keys.shape[0], op="indexer_scores")
    cd = compute_dtype(q, head_weights, keys)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    kc = upcast(keys, cd)
    max_kv = max((k1 - k0 for _, _, k0, k1 in spans), default=0)
    out = torch.full((T, max_kv), float("-inf"), dtype=cd, device=q.device)
    for q0, q1, k0, k1 in spans:
        kv_len = k1 - k0
        if q1 == q0 or kv_len == 0:
            continue
        step = max(1, BLOCK_ELEMENTS // (Hi * kv_len))
        q_pos_all = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)
        for b0 in range(q0, q1, step):
            b1 = min(q1, b0 + step)
            prod = torch.relu(torch.einsum("thd,sd->ths", qc[b0:b1], kc[k0:k1]))          # [tb, Hi, S]
            acc = torch.einsum("ths,th->ts", prod, w[b0:b1])                               # [tb, S]
            causal = allowed_mask(q_pos_all[b0 - q0:b1 - q0], kv_len, max_kv=kv_len)
            out[b0:b1, :kv_len] = acc.masked_fill(~causal, float("-inf"))
    return out
