"""Absorbed (MQA) MLA decode over the paged latent cache in torch, without host
synchronisation: what the reference platform serves as `mla.decode`. `k3.plugin.kernels.MLADecode`
is the contract; `k3.reference.mla_decode`, one query at a time over its own sequence's
positions, is its oracle. Every sequence's rows are gathered padded to max_pages * page_size
and masked, so one call is one fixed-shape graph.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import allowed_mask, check_topk_indices, masked_softmax
from k3.quant.fp8 import FP8_DTYPES, fp8_dequantize


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    kv_cache_scale: torch.Tensor | float | None = None,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """`MLADecode`, batched: the module docstring."""
    op = "mla_decode"
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"{op}: q_nope must be [T, H, Dn] and q_pe [T, H, Dr]; "
            f"got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}"
        )
    T, H, Dn = q_nope.shape
    R = w_uk.shape[-1]
    if w_uk.dim() != 3 or w_uk.shape[:2] != (H, Dn) or w_uv.dim() != 3 or w_uv.shape[:2] != (H, R):
        raise ValueError(
            f"{op}: w_uk must be [H={H}, Dn={Dn}, R] and w_uv [H, R, Dv]; "
            f"got {tuple(w_uk.shape)}, {tuple(w_uv.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != R + q_pe.shape[2]:
        raise ValueError(
            f"{op}: kv_cache must be [P, page_size, R+Dr={R + q_pe.shape[2]}]; "
            f"got {tuple(kv_cache.shape)}"
        )
    N = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if N < 1 or block_table.dim() != 2 or block_table.shape[0] != N:
        raise ValueError(
            f"{op}: seq_lens must be [N] and block_table [N, max_pages]; "
            f"got {tuple(seq_lens.shape)}, {tuple(block_table.shape)}"
        )
    cu_shape = None if cu_seqlens_q is None else tuple(cu_seqlens_q.shape)
    if (cu_shape is None and T != N) or (cu_shape is not None and cu_shape != (N + 1,)):
        raise ValueError(
            f"{op}: cu_seqlens_q must be int [N+1={N + 1}] (or None with T == N); "
            f"got T={T}, cu_seqlens_q {cu_shape}"
        )
    check_topk_indices(topk_indices, T, op)
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8 and kv_cache_scale is None:
        raise ValueError(f"{op}: an fp8 kv_cache ({kv_cache.dtype}) needs a kv_cache_scale")
    dev = q_nope.device
    cd = compute_dtype(q_nope, q_pe, w_uk, w_uv, None if is_fp8 else kv_cache)
    P, page_size, C = kv_cache.shape
    max_kv = block_table.shape[1] * page_size

    # every sequence's rows, padded to max_kv; unused pages are clamped and masked later
    rows = kv_cache[block_table.long().clamp(0, P - 1)].reshape(N, max_kv, C)  # [N, max_kv, R+Dr]
    rows = fp8_dequantize(rows, kv_cache_scale, dtype=cd) if is_fp8 else upcast(rows, cd)
    lens = seq_lens.long()
    if cu_seqlens_q is None:
        seq_of = torch.arange(N, device=dev)  # [T]
        q_pos = lens - 1
    else:
        cu = cu_seqlens_q.long()
        t = torch.arange(T, device=dev)
        # sequence of each query token: how many sequence ends lie at or before it (a comparison
        # sum rather than searchsorted, which some graph backends cannot lower)
        seq_of = (cu[1:][None, :] <= t[:, None]).sum(-1).clamp(max=N - 1)  # [T]
        q_pos = lens[seq_of] - (cu[seq_of + 1] - t)  # last q_len tokens of the sequence
    allowed = allowed_mask(q_pos, lens[seq_of], max_kv=max_kv, topk_indices=topk_indices)
    visible = torch.arange(max_kv, device=dev) < lens[:, None]  # [N, max_kv]
    rows = torch.where(visible[..., None], rows, 0)  # never read past seq_len (NaN-safe)

    q_lat = torch.einsum("thd,hdr->thr", upcast(q_nope, cd), upcast(w_uk, cd))  # [T, H, R]
    q_full = torch.cat([q_lat, upcast(q_pe, cd)], -1)  # [T, H, R+Dr]
    # [T, max_kv, R+Dr]: each query's sequence (one query a sequence: the rows as gathered, no copy)
    rows_t = rows if cu_seqlens_q is None else rows[seq_of]
    scores = torch.einsum("thc,tsc->ths", q_full, rows_t) * scale  # [T, H, max_kv]
    p = masked_softmax(scores, allowed[:, None, :])
    out_lat = torch.einsum("ths,tsr->thr", p, rows_t[..., :R])  # [T, H, R]
    return torch.einsum("thr,hrv->thv", out_lat, upcast(w_uv, cd)).to(q_nope.dtype)
