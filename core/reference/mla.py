"""Multi-head latent attention (K3's NoPE MLA), the oracle: attention as an explicit masked
softmax, one sequence (prefill) or one query (decode) at a time.

The contract (cache row layout, varlen rule, DSA selection) is `k3.plugin.kernels.mla`.
`mla_expand_kv` and `mla_absorb_weights` are the two weight forms the model uses. The reference
platform serves `k3.platforms.torch_kernels.mla_decode` (batched, padded, no host
synchronisation) for decode, which conformance checks against `mla_decode` here.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import allowed_mask, check_topk_indices, masked_softmax, varlen_spans
from k3.quant.fp8 import FP8_DTYPES, fp8_dequantize


def _split_kv_b(w: torch.Tensor, num_heads: int, dn: int, dv: int, op: str) -> torch.Tensor:
    """kv_b_proj.weight [H*(Dn+Dv), R] -> [H, Dn+Dv, R]."""
    if w.dim() != 2 or w.shape[0] != num_heads * (dn + dv):
        raise ValueError(
            f"{op}: kv_b_weight must be [H*(Dn+Dv)={num_heads * (dn + dv)}, R]; "
            f"got {tuple(w.shape)}"
        )
    return w.reshape(num_heads, dn + dv, w.shape[1])


def mla_expand_kv(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand cached latents to per-head keys and values (the MHA form).

    latent [S, R], k_pe [S, Dr], kv_b_weight [H*(Dn+Dv), R].
    Returns k [S, H, Dn+Dr] = [latent W_k^h | k_pe] (k_pe shared by all heads), v [S, H, Dv];
    matmul in fp32 (fp64 for float64 input), cast to latent.dtype.
    """
    op = "mla_expand_kv"
    if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != latent.shape[0]:
        raise ValueError(
            f"{op}: latent must be [S, R] and k_pe [S, Dr]; "
            f"got {tuple(latent.shape)}, {tuple(k_pe.shape)}"
        )
    w = _split_kv_b(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim, op)
    if w.shape[-1] != latent.shape[1]:
        raise ValueError(
            f"{op}: kv_b_weight must be [H*(Dn+Dv), R={latent.shape[1]}]; "
            f"got {tuple(kv_b_weight.shape)}"
        )
    cd = compute_dtype(latent, k_pe, kv_b_weight)
    kv = torch.einsum("sr,hdr->shd", upcast(latent, cd), upcast(w, cd))  # [S, H, Dn+Dv]
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    pe = upcast(k_pe, cd)[:, None, :].expand(-1, num_heads, -1)  # [S, H, Dr]
    return torch.cat([k_nope, pe], -1).to(latent.dtype), v.to(latent.dtype)


def mla_prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    scale: float,
    qk_nope_head_dim: int,
    v_head_dim: int,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Oracle of `MLAPrefill`: per sequence, the expanded keys and values, scores over its
    context, the causal (and DSA) mask, softmax, the value sum."""
    op = "mla_prefill"
    dqk = qk_nope_head_dim + k_pe.shape[-1]
    if q.dim() != 3 or q.shape[-1] != dqk:
        raise ValueError(f"{op}: q must be [T, H, Dn+Dr={dqk}]; got {tuple(q.shape)}")
    T, H, _ = q.shape
    check_topk_indices(topk_indices, T, op)
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=T, num_kv=latent.shape[0], op=op)
    cd = compute_dtype(q, latent, k_pe, kv_b_weight)
    k, v = mla_expand_kv(
        upcast(latent, cd), upcast(k_pe, cd), upcast(kv_b_weight, cd),
        num_heads=H, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
    )  # [S, H, Dn+Dr], [S, H, Dv]
    qc = upcast(q, cd)
    o = torch.zeros(T, H, v_head_dim, dtype=cd, device=q.device)
    for q0, q1, k0, k1 in spans:
        if q1 == q0:
            continue
        kv_len = k1 - k0
        q_pos = torch.arange(kv_len - (q1 - q0), kv_len, device=q.device)  # [Tq]
        sel = None if topk_indices is None else topk_indices[q0:q1]
        allowed = allowed_mask(q_pos, kv_len, max_kv=kv_len, topk_indices=sel)  # [Tq, Skv]
        scores = torch.einsum("thd,shd->hts", qc[q0:q1], k[k0:k1]) * scale  # [H, Tq, Skv]
        p = masked_softmax(scores, allowed[None])
        o[q0:q1] = torch.einsum("hts,shd->thd", p, v[k0:k1])
    return o.to(q.dtype)


def mla_absorb_weights(
    kv_b_weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split kv_b_proj.weight [H*(Dn+Dv), R] into w_uk [H, Dn, R] and w_uv [H, R, Dv].

    q_lat = q_nope @ w_uk (per head), o = out_latent @ w_uv. Same dtype as the weight (no math).
    """
    w = _split_kv_b(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim, "mla_absorb_weights")
    w_uk = w[:, :qk_nope_head_dim].contiguous()  # [H, Dn, R]
    return w_uk, w[:, qk_nope_head_dim:].transpose(1, 2).contiguous()  # [H, R, Dv]


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
    """Oracle of `MLADecode`: per query, its sequence's rows read position by position through
    the block table (only positions < seq_len), absorbed scores, masked softmax, latent sum,
    times w_uv. Reads seq_lens, the block table and cu_seqlens_q on the host."""
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
    cd = compute_dtype(q_nope, q_pe, w_uk, w_uv, None if is_fp8 else kv_cache)
    page_size = kv_cache.shape[1]
    lens, table = seq_lens.tolist(), block_table.tolist()              # host reads (the oracle may)
    cu = list(range(N + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    wk, wv = upcast(w_uk, cd), upcast(w_uv, cd)
    o = torch.zeros(T, H, w_uv.shape[-1], dtype=cd, device=q_nope.device)
    for n in range(N):
        length = int(lens[n])
        pos = torch.arange(length)
        pages = torch.tensor([table[n][s // page_size] for s in range(length)], dtype=torch.long)
        at = (pages.to(kv_cache.device), (pos % page_size).to(kv_cache.device))
        # fp8 rows gathered as bytes: torch 2.9's CPU cannot index float8 tensors (the torch-xla venv)
        rows = kv_cache.view(torch.uint8)[at].view(kv_cache.dtype) if is_fp8 and kv_cache.device.type == "cpu" \
            else kv_cache[at]   # [L, R+Dr]
        rows = fp8_dequantize(rows, kv_cache_scale, dtype=cd) if is_fp8 else upcast(rows, cd)
        for t in range(cu[n], cu[n + 1]):
            q_pos = length - (cu[n + 1] - t)                           # the sequence's last q_len tokens
            q_lat = torch.einsum("hd,hdr->hr", upcast(q_nope[t], cd), wk)                  # [H, R]
            scores = torch.cat([q_lat, upcast(q_pe[t], cd)], -1) @ rows.T * scale          # [H, L]
            sel = None if topk_indices is None else topk_indices[t: t + 1]
            allowed = allowed_mask(torch.tensor([q_pos], device=rows.device), length, max_kv=length,
                                   topk_indices=sel)                   # [1, L]
            p = masked_softmax(scores, allowed)                        # [H, L]
            o[t] = torch.einsum("hr,hrv->hv", p @ rows[:, :R], wv)     # [H, Dv]
    return o.to(q_nope.dtype)
