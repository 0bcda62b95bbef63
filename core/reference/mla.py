"""Multi-head latent attention (K3's NoPE MLA): expanded prefill, absorbed paged decode, sparse.

Per token the cache holds one row [c (R) | k_pe (Dr)]: the latent after kv_a_layernorm and the
shared, never rotated, pe key. `kv_b_proj.weight` is [H*(Dn+Dv), R]: per head Dn rows of k_nope,
then Dv rows of v. K3: H = 96, Dn = 128, Dr = 64, Dv = 128, R = 512, scale = 1/sqrt(Dn+Dr).

Varlen convention shared by every op here and by the DSA indexer: sequence n has kv_len_n context
tokens and q_len_n <= kv_len_n queries, its LAST q_len_n tokens; query i sits at position
kv_len_n - q_len_n + i and attends to positions <= its own. With `topk_indices` [T, k] (positions
within the sequence, -1 = padding) a query attends only to the selected positions, still causally
(DSA sparse MLA). A query with nothing to attend to outputs zeros.
"""

from __future__ import annotations

import torch

from ..quant.fp8 import FP8_DTYPES, fp8_dequantize
from ..dtypes import compute_dtype, upcast


def varlen_spans(
    cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, *, num_q: int, num_kv: int, op: str
) -> list[tuple[int, int, int, int]]:
    """[(q_start, q_end, kv_start, kv_end)] per sequence, checked on the host.

    cu_seqlens_q, cu_seqlens_kv: integer [N+1], from 0, non-decreasing, ending at num_q / num_kv,
    with q_len_n <= kv_len_n.
    """
    cus = []
    for name, cu, total in (
        ("cu_seqlens_q", cu_seqlens_q, num_q),
        ("cu_seqlens_kv", cu_seqlens_kv, num_kv),
    ):
        if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
            raise ValueError(
                f"{op}: {name} must be an integer tensor [N+1]; got {cu.dtype} {tuple(cu.shape)}"
            )
        c = [int(v) for v in cu.tolist()]
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(
                f"{op}: {name} must start at 0, be non-decreasing and end at {total}; got {c}"
            )
        cus.append(c)
    cq, ck = cus
    if len(cq) != len(ck):
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_kv must both be [N+1]; got {len(cq)} vs {len(ck)}"
        )
    spans = list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))
    for n, (q0, q1, k0, k1) in enumerate(spans):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"{op}: sequence {n} has q_len {q1 - q0} > kv_len {k1 - k0}")
    return spans


def allowed_mask(
    q_pos: torch.Tensor,
    kv_len: int | torch.Tensor,
    *,
    max_kv: int,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [T, max_kv]: position s is visible to a query at q_pos[t] (s <= q_pos, s < kv_len).

    q_pos: int [T]; kv_len: int or int [T]; topk_indices: int [T, k] or None. With indices, only
    selected positions stay visible; -1 and out-of-range entries select nothing.
    """
    s = torch.arange(max_kv, device=q_pos.device)
    kv_len = torch.as_tensor(kv_len, device=q_pos.device).reshape(-1, 1)
    ok = (s <= q_pos[:, None]) & (s < kv_len)  # [T, max_kv]
    if topk_indices is None:
        return ok
    idx = topk_indices.long()
    idx = torch.where((idx >= 0) & (idx < max_kv), idx, max_kv)  # invalid -> spill column
    sel = torch.zeros(idx.shape[0], max_kv + 1, dtype=torch.bool, device=q_pos.device)
    sel.scatter_(1, idx, True)
    return ok & sel[:, :max_kv]


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis of scores where allowed, zeros on rows with nothing allowed."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, 0.0))  # masked -> exp(-inf) = 0
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def _check_topk(topk_indices: torch.Tensor | None, T: int, op: str) -> None:
    if topk_indices is not None and (
        topk_indices.dim() != 2 or topk_indices.shape[0] != T or topk_indices.is_floating_point()
    ):
        raise ValueError(
            f"{op}: topk_indices must be an integer tensor [T={T}, k]; "
            f"got {topk_indices.dtype} {tuple(topk_indices.shape)}"
        )


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
    """Varlen MLA in the expanded (MHA) form, dense causal or DSA sparse.

    q [T, H, Dn+Dr] (nothing rotated); latent [S, R]; k_pe [S, Dr]; kv_b_weight [H*(Dn+Dv), R];
    cu_seqlens_q / cu_seqlens_kv int [N+1] (kv = each sequence's earlier context then its new
    tokens; queries are its last q_len tokens, see the module docstring); scale: softmax scale
    (1/sqrt(Dn+Dr)); topk_indices: int [T, k] positions within the sequence, -1 = padding.
    Returns o [T, H, Dv] in q.dtype; scores, softmax and the value sum in fp32 (fp64 for float64).
    Reads cu_seqlens on the host.
    """
    op = "mla_prefill"
    dqk = qk_nope_head_dim + k_pe.shape[-1]
    if q.dim() != 3 or q.shape[-1] != dqk:
        raise ValueError(f"{op}: q must be [T, H, Dn+Dr={dqk}]; got {tuple(q.shape)}")
    T, H, _ = q.shape
    _check_topk(topk_indices, T, op)
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
        p = _masked_softmax(scores, allowed[None])
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
    """MLA in the absorbed (MQA) form over a paged latent cache (decode, spec-decode verify).

    q_nope [T, H, Dn], q_pe [T, H, Dr]; kv_cache [P, page_size, R+Dr] (bf16/fp32/fp64, or fp8
    with a per-tensor fp32 kv_cache_scale); block_table int [N, max_pages]: position p of
    sequence n is kv_cache[block_table[n, p // page_size], p % page_size]; seq_lens int [N]:
    context length including the query tokens (already written); w_uk [H, Dn, R], w_uv [H, R, Dv];
    cu_seqlens_q int [N+1] or None (one query per sequence); topk_indices int [T, k] or None.
    Score = [q_nope w_uk | q_pe] . row * scale; out latent = softmax-weighted sum of row[:R];
    o = out_latent w_uv. Returns [T, H, Dv] in q_nope.dtype; all math in fp32 (fp64 for float64).
    No host synchronisation: every sequence is padded to max_pages * page_size and masked.
    """
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
    _check_topk(topk_indices, T, op)
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
    rows_t = rows[seq_of]  # [T, max_kv, R+Dr]: each query's sequence
    scores = torch.einsum("thc,tsc->ths", q_full, rows_t) * scale  # [T, H, max_kv]
    p = _masked_softmax(scores, allowed[:, None, :])
    out_lat = torch.einsum("ths,tsr->thr", p, rows_t[..., :R])  # [T, H, R]
    return torch.einsum("thr,hrv->thv", out_lat, upcast(w_uv, cd)).to(q_nope.dtype)
