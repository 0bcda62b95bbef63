"""MLA prefill for XLA: `MLAKernels.prefill` without the host read of `cu_seqlens`.

`k3.plugin.kernels.MLAPrefill` is the contract, `k3.reference.mla_prefill` its oracle (one
Python iteration per sequence over spans read on the host). Here every query scores every
packed key row at once (`[H, T, S]`, static shapes) and a mask built by device arithmetic
keeps what the varlen rule allows: the key is in the query's sequence and at or before its
position (`kv_len - q_len + i`), and, with `topk_indices`, among its selected positions. Rows
with nothing allowed give zeros, as the contract says.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import masked_softmax
from k3.reference.mla import mla_expand_kv

from . import varlen


def visible(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, T: int, S: int,
            topk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """bool [T, S]: packed key row j is visible to packed query t under the varlen rule
    (`k3.plugin.kernels.mla`), with `topk_indices` [T, k] (positions within the sequence, -1
    padding) restricting it further. Device arithmetic only."""
    N = cu_seqlens_q.shape[0] - 1
    seq_q, i_q = varlen.token_sequences(cu_seqlens_q, T)
    seq_k, pos_k = varlen.token_sequences(cu_seqlens_kv, S)
    n = seq_q.clamp(max=N - 1)
    kv_len = varlen.lengths(cu_seqlens_kv).gather(0, n)                          # [T]
    q_pos = kv_len - varlen.lengths(cu_seqlens_q).gather(0, n) + i_q             # [T]
    ok = (seq_q[:, None] == seq_k[None, :]) & (seq_q < N)[:, None] & (pos_k[None, :] <= q_pos[:, None])
    if topk_indices is None:
        return ok
    idx = topk_indices.long()
    start = cu_seqlens_kv.long()[:-1].gather(0, n)
    cols = torch.where((idx >= 0) & (idx < kv_len[:, None]), start[:, None] + idx, S)   # invalid -> spill column
    width = max(S + 1, idx.shape[1])                  # XLA's scatter wants the index no wider than its target
    sel = torch.zeros(T, width, dtype=torch.bool, device=ok.device).scatter(1, cols, True)
    return ok & sel[:, :S]


def mla_prefill(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, *,
                cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, scale: float, qk_nope_head_dim: int,
                v_head_dim: int, topk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`MLAPrefill` over every packed key at once, masked (the module docstring)."""
    op = "mla_prefill"
    dqk = qk_nope_head_dim + k_pe.shape[-1]
    if q.dim() != 3 or q.shape[-1] != dqk:
        raise ValueError(f"{op}: q must be [T, H, Dn+Dr={dqk}]; got {tuple(q.shape)}")
    if topk_indices is not None and (topk_indices.dim() != 2 or topk_indices.shape[0] != q.shape[0]
                                     or topk_indices.is_floating_point()):
        raise ValueError(f"{op}: topk_indices must be an integer tensor [T, k]; got {tuple(topk_indices.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_kv must both be [N+1]; got "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(cu_seqlens_kv.shape)}")
    T, H, _ = q.shape
    S = latent.shape[0]
    cd = compute_dtype(q, latent, k_pe, kv_b_weight)
    k, v = mla_expand_kv(upcast(latent, cd), upcast(k_pe, cd), upcast(kv_b_weight, cd), num_heads=H,
                         qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)    # [S, H, Dn+Dr], [S, H, Dv]
    allowed = visible(cu_seqlens_q, cu_seqlens_kv, T, S, topk_indices)              # [T, S]
    scores = torch.einsum("thd,shd->hts", upcast(q, cd), k) * scale                  # [H, T, S]
    p = masked_softmax(scores, allowed[None])
    return torch.einsum("hts,shd->thd", p, v).to(q.dtype)
