"""MLA prefill (expanded form) on torch's fused attention: `MLAKernels.prefill` (see
k3.reference.mla_prefill for the contract).

The reference expands the latents to per-head keys and values in fp32 and materialises the
[H, Tq, Skv] scores of every sequence. Here the expansion is one matmul in the activation dtype
and each sequence's attention is one `scaled_dot_product_attention` call with a lower-right
causal mask (the queries are the last q_len of the sequence's kv tokens, so chunked prefill
after a prefix is the same call), which torch runs on its flash or memory-efficient kernels on
a GPU: no score matrix in memory. DSA selections (`topk_indices`) and float64 go to the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k3 import reference as ref
from k3.ops_helpers import varlen_spans


def mla_prefill(q, latent, k_pe, kv_b_weight, *, cu_seqlens_q, cu_seqlens_kv, scale, qk_nope_head_dim, v_head_dim,
                topk_indices=None):
    """`k3.reference.mla_prefill` with torch's fused attention (same signature and contract)."""
    if topk_indices is not None or q.dtype == torch.float64:
        return ref.mla_prefill(q, latent, k_pe, kv_b_weight, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                               scale=scale, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                               topk_indices=topk_indices)
    t, h, _ = q.shape
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=t, num_kv=latent.shape[0], op="mla_prefill")
    k, v = ref.mla_expand_kv(latent.to(q.dtype), k_pe.to(q.dtype), kv_b_weight.to(q.dtype), num_heads=h,
                         qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)      # [S, H, Dqk], [S, H, Dv]
    o = q.new_zeros(t, h, v_head_dim)
    for q0, q1, k0, k1 in spans:
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1)[None]                                            # [1, H, Tq, Dqk]
        ks, vs = k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None]          # [1, H, Skv, D]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(q1 - q0, k1 - k0),
                                             scale=scale)
        o[q0:q1] = out[0].transpose(0, 1)
    return o
