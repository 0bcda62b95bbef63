"""Batch-invariant MLA (`MLAKernels`, `k3.plugin.kernels.mla`): every query, decode or prefill,
attends in the absorbed (MQA) form over its own sequence's latents in position order.

Per query t of sequence n at position q_pos (keys 0..q_pos, or its DSA selection of them):

    q_lat  = ordered_sum_Dn(q_nope * w_uk)                            [H, R]
    score  = ordered_sum_C([q_lat | q_pe] * row) * scale              per key, C = R + Dr
    m      = max over the allowed keys (exact in any order)
    den    = sum over key blocks b = 0, 1, ... of ordered_sum(exp(score - m)) within the block
    num    = the same sums of exp(score - m) * latent
    o      = ordered_sum_R(num / den * w_uv)                          [H, Dv]

Keys come in blocks of KEY_BLOCK positions, added in position order; a block past a query's
own context adds exact zeros, so the number of blocks a batch needs changes nothing. `decode`
reads the rows through the block table (one query per sequence, or `cu_seqlens_q`'s queries),
`prefill` from the gathered rows and the whole kv_b_proj (split into w_uk / w_uv as the model
splits it): both run the same function, so a prefill token equals its decode bit for bit.
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import check_topk_indices, varlen_spans
from k3.quant.fp8 import FP8_DTYPES, fp8_dequantize

from k3.ops_helpers import invariant as p


def _selection(topk_indices: torch.Tensor | None, t: int, width: int, device) -> torch.Tensor | None:
    """bool [T, width]: the positions each query's DSA top-k names (-1 entries name none)."""
    if topk_indices is None:
        return None
    idx = topk_indices.long()
    chosen = torch.zeros(t, width + 1, dtype=torch.bool, device=device)
    chosen.scatter_(1, torch.where(idx >= 0, idx, width), True)
    return chosen[:, :width]


def _attend(q_nope, q_pe, w_uk, w_uv, keys, seq_of, q_pos, selected, scale, cd) -> torch.Tensor:
    """keys [N, L, R + Dr] (L a multiple of KEY_BLOCK, zero past each sequence's length) in cd;
    seq_of / q_pos [T]; selected bool [T, L] or None. Returns [T, H, Dv] q_nope.dtype."""
    r = w_uk.shape[-1]
    q_lat = p.ordered_dot(upcast(q_nope, cd)[..., None], upcast(w_uk, cd)[None], 2)          # [T, H, R]
    q_full = torch.cat([q_lat, upcast(q_pe, cd)], -1)                                        # [T, H, C]
    kb = p.KEY_BLOCK
    blocks, scores = [], []
    for start in range(0, keys.shape[1], kb):
        rows = keys[seq_of, start: start + kb]                                               # [T, KB, C]
        s = p.ordered_dot(q_full[:, :, None, :], rows[:, None], -1) * scale                 # [T, H, KB]
        ok = torch.arange(start, start + kb, device=keys.device)[None, :] <= q_pos[:, None]  # [T, KB]
        if selected is not None:
            ok = ok & selected[:, start: start + kb]
        blocks.append(rows[..., :r])
        scores.append(s.masked_fill(~ok[:, None, :], float("-inf")))
    m = torch.stack([s.amax(-1) for s in scores]).amax(0)                                   # [T, H]
    den = torch.zeros_like(m)
    num = q_lat.new_zeros(q_lat.shape)
    for s, latent in zip(scores, blocks):
        e = p.exp(s - m[..., None])                                                          # [T, H, KB]
        den = den + p.ordered_sum(e, -1)
        num = num + p.ordered_dot(e[..., None], latent[:, None], -2)                         # [T, H, R]
    out = num / den[..., None]
    return p.ordered_dot(out[..., None], upcast(w_uv, cd)[None], -2).to(q_nope.dtype)       # [T, H, Dv]


def _padded(length: int) -> int:
    return max(1, -(-length // p.KEY_BLOCK)) * p.KEY_BLOCK


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float,
           cu_seqlens_q: torch.Tensor | None = None, kv_cache_scale: torch.Tensor | float | None = None,
           topk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`MLADecode` (the module docstring); reads seq_lens and cu_seqlens_q on the host."""
    op = "mla_decode"
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"{op}: q_nope must be [T, H, Dn] and q_pe [T, H, Dr]; "
                         f"got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}")
    t = q_nope.shape[0]
    n = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != n:
        raise ValueError(f"{op}: seq_lens must be [N] and block_table [N, max_pages]; "
                         f"got {tuple(seq_lens.shape)}, {tuple(block_table.shape)}")
    if (cu_seqlens_q is None and t != n) or (cu_seqlens_q is not None and tuple(cu_seqlens_q.shape) != (n + 1,)):
        raise ValueError(f"{op}: cu_seqlens_q must be int [N+1={n + 1}] (or None with T == N); got T={t}")
    check_topk_indices(topk_indices, t, op)
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8 and kv_cache_scale is None:
        raise ValueError(f"{op}: an fp8 kv_cache ({kv_cache.dtype}) needs a kv_cache_scale")
    cd = compute_dtype(q_nope, q_pe, w_uk, w_uv, None if is_fp8 else kv_cache)
    dev = q_nope.device
    lens = seq_lens.long().to(dev)
    width = _padded(int(lens.max()) if n else 1)
    num_pages, page_size = kv_cache.shape[:2]
    pos = torch.arange(width, device=dev)
    cols = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[:, cols].clamp(0, num_pages - 1)                              # [N, L]
    rows = kv_cache[pages, (pos % page_size)[None, :].expand(n, width)]                      # [N, L, C]
    rows = fp8_dequantize(rows, kv_cache_scale, dtype=cd) if is_fp8 else upcast(rows, cd)
    rows = torch.where((pos[None, :] < lens[:, None])[..., None], rows, 0)
    if cu_seqlens_q is None:
        seq_of, q_pos = torch.arange(n, device=dev), lens - 1
    else:
        cu = cu_seqlens_q.long().to(dev)
        seq_of = torch.repeat_interleave(torch.arange(n, device=dev), cu[1:] - cu[:-1], output_size=t)
        q_pos = lens[seq_of] - (cu[seq_of + 1] - torch.arange(t, device=dev))
    return _attend(q_nope, q_pe, w_uk, w_uv, rows, seq_of, q_pos, _selection(topk_indices, t, width, dev), scale,
                   cd)


def prefill(q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor, *,
            cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, scale: float, qk_nope_head_dim: int,
            v_head_dim: int, topk_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`MLAPrefill` in the absorbed form, the same function as `decode` (the module docstring)."""
    op = "mla_prefill"
    dn = qk_nope_head_dim
    if q.dim() != 3 or q.shape[-1] != dn + k_pe.shape[-1]:
        raise ValueError(f"{op}: q must be [T, H, Dn+Dr={dn + k_pe.shape[-1]}]; got {tuple(q.shape)}")
    t, h, _ = q.shape
    check_topk_indices(topk_indices, t, op)
    spans = varlen_spans(cu_seqlens_q, cu_seqlens_kv, num_q=t, num_kv=latent.shape[0], op=op)
    w_uk, w_uv = ref.mla_absorb_weights(kv_b_weight, num_heads=h, qk_nope_head_dim=dn, v_head_dim=v_head_dim)
    cd = compute_dtype(q, latent, k_pe, kv_b_weight)
    width = _padded(max((k1 - k0 for _, _, k0, k1 in spans), default=1))
    keys = torch.zeros(len(spans), width, latent.shape[1] + k_pe.shape[1], dtype=cd, device=q.device)
    seq_of = torch.empty(t, dtype=torch.long, device=q.device)
    q_pos = torch.empty(t, dtype=torch.long, device=q.device)
    for n, (q0, q1, k0, k1) in enumerate(spans):
        keys[n, : k1 - k0] = torch.cat([upcast(latent[k0:k1], cd), upcast(k_pe[k0:k1], cd)], -1)
        seq_of[q0:q1] = n
        q_pos[q0:q1] = torch.arange(k1 - k0 - (q1 - q0), k1 - k0, device=q.device)
    return _attend(q[..., :dn], q[..., dn:], w_uk, w_uv, keys, seq_of, q_pos,
                   _selection(topk_indices, t, width, q.device), scale, cd)
