"""MLA attention under decode context parallelism (DCP): token-interleaved records, partial
attention per rank, the log-sum-exp combine.

Rank r of a DCP group of W stores the attention records (latent row `[c | k_pe]`, DSA index key)
of the tokens at positions p with p % W == r, at its local position p // W: the block table and
the page pool address local positions, so a sequence of L tokens takes ceil((L - r) / W) rows on
rank r (`DecodeContextParallel.local_lens`). `ForwardMetadata.slot_mapping` is not used under DCP:
`dcp_token_slots` derives each owned token's local slot from its position and the block table.

Every query (decode, prefill chunk, verify alike) attends on each rank over that rank's records
only, with the causal mask in global positions (local j is global j * W + r) and the DSA
selection when there is one, in the absorbed (MQA) form. Each rank's result is its normalised
partial output o_r and log-sum-exp l_r per head; the exact output is
    o = sum_r exp(l_r - m) o_r / sum_r exp(l_r - m),    m = max_r l_r
(a rank with nothing visible has l_r = -inf and weight 0). The combine travels on the latent
(R values + 1 per head), before w_uv, which is linear.

When the DCP group lies inside the tensor-parallel group (`DecodeContextParallel.heads_split`,
vLLM's layout), its ranks hold different heads: the absorbed queries [T, H_local, R + Dr] are
all-gathered over the group first, every rank attends with all of the group's heads over its
own tokens, and keeps its heads of the combined output.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype, upcast
from k3.model.metadata import ForwardMetadata
from k3.quant.fp8 import FP8_DTYPES, fp8_dequantize

from .parallel import DecodeContextParallel


def token_sequences(meta: ForwardMetadata) -> torch.Tensor:
    """[T] int64: the sequence of each new token (from cu_seqlens; no host read)."""
    t = torch.arange(meta.num_tokens, device=meta.cu_seqlens.device)
    return (meta.cu_seqlens[1:].long()[None, :] <= t[:, None]).sum(-1).clamp(max=meta.num_seqs - 1)


def dcp_token_slots(meta: ForwardMetadata, page_size: int,
                    dcp: DecodeContextParallel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owned [T] bool, page [T], offset [T]): which new tokens this rank stores and where (the
    page and offset of local position p // W of the token's sequence; meaningless where not
    owned)."""
    local = meta.positions // dcp.size                                        # [T]
    seq = token_sequences(meta)
    pages = meta.block_table[seq, local // page_size].long()
    return dcp.owns(meta.positions), pages, local % page_size


def local_rows(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Every sequence's local rows, padded: cache [P, page_size, *row] -> [N, max_pages *
    page_size, *row] (rows past a sequence's local length are whatever the pages hold)."""
    n, pages = block_table.shape
    rows = cache[block_table.long().clamp(0, cache.shape[0] - 1)]             # [N, pages, page_size, *row]
    return rows.reshape(n, pages * cache.shape[1], *cache.shape[2:])


def local_visible(meta: ForwardMetadata, dcp: DecodeContextParallel, max_local: int) -> torch.Tensor:
    """bool [T, max_local]: local position j is stored (j < the sequence's local length) and
    causally visible to the query (global j * W + rank <= the query's position)."""
    seq = token_sequences(meta)
    j = torch.arange(max_local, device=meta.positions.device)
    stored = j[None, :] < dcp.local_lens(meta.seq_lens)[seq][:, None]
    return stored & (j[None, :] * dcp.size + dcp.rank <= meta.positions[:, None])


def partial_attention(q: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, allowed: torch.Tensor, *,
                      scale: float, latent_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of q [T, H, R + Dr] over this rank's rows [N, Lmax, R + Dr] (query t
    reads sequence seq[t]'s rows where allowed [T, Lmax]) in q's dtype. Returns the normalised
    latent output [T, H, R] (0 where nothing is allowed) and the log-sum-exp [T, H] (-inf there)."""
    rows_t = torch.where(allowed[..., None], rows[seq], 0)                    # [T, Lmax, R + Dr]; never read
                                                                              # unwritten rows (NaN-safe)
    scores = torch.einsum("thc,tsc->ths", q, rows_t) * scale                  # [T, H, Lmax]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    m = scores.amax(-1, keepdim=True)                                         # [T, H, 1]
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(scores - m)                                                 # masked -> 0
    total = p.sum(-1, keepdim=True)                                           # [T, H, 1]
    out = torch.einsum("ths,tsr->thr", p / total.clamp_min(torch.finfo(p.dtype).tiny), rows_t[..., :latent_dim])
    lse = torch.where(total > 0, m + torch.log(total), float("-inf")).squeeze(-1)
    return out, lse


def combine(out: torch.Tensor, lse: torch.Tensor, dcp: DecodeContextParallel) -> torch.Tensor:
    """The exact attention output [T, H, R] from every rank's partial (out [T, H, R], lse [T, H])
    by log-sum-exp weights (module docstring); one all-gather of [T, H, R + 1]."""
    parts = dcp.stack_gather(torch.cat([out, lse[..., None]], -1))            # [W, T, H, R + 1]
    outs, lses = parts[..., :-1], parts[..., -1]
    m = lses.amax(0)                                                          # [T, H]
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lses - m)                                                   # [W, T, H]; -inf -> 0
    return (w[..., None] * outs).sum(0) / w.sum(0).clamp_min(torch.finfo(w.dtype).tiny)[..., None]


def dequantized_rows(pages: torch.Tensor, block_table: torch.Tensor, scale: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """local_rows of a latent view in `dtype` (fp8 pages dequantised with their scale)."""
    rows = local_rows(pages, block_table)
    if pages.dtype in FP8_DTYPES:
        return fp8_dequantize(rows, scale, dtype=dtype)
    return upcast(rows, dtype)


def dcp_mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                      pages: torch.Tensor, kv_cache_scale: torch.Tensor | None, meta: ForwardMetadata,
                      dcp: DecodeContextParallel, *, scale: float,
                      selected: torch.Tensor | None = None) -> torch.Tensor:
    """MLA attention of every new token over the whole context held by the DCP group.

    q_nope [T, H, Dn], q_pe [T, H, Dr]; w_uk [H, Dn, R], w_uv [H, R, Dv]; pages [P, page_size,
    R + Dr] this rank's latent pages (this call's owned rows already written); selected: bool
    [T, Lmax] the DSA selection in local positions (None: dense). Returns [T, H, Dv] in
    q_nope's dtype, the same on every DCP rank."""
    cd = compute_dtype(q_nope, q_pe, w_uk, w_uv, None if pages.dtype in FP8_DTYPES else pages)
    r = w_uk.shape[-1]
    rows = dequantized_rows(pages, meta.block_table, kv_cache_scale, cd)      # [N, Lmax, R + Dr]
    allowed = local_visible(meta, dcp, rows.shape[1])
    if selected is not None:
        allowed = allowed & selected
    q_lat = torch.einsum("thd,hdr->thr", upcast(q_nope, cd), upcast(w_uk, cd))  # [T, H, R]
    q_full = torch.cat([q_lat, upcast(q_pe, cd)], -1)                         # [T, H, R + Dr]
    h = q_full.shape[1]
    if dcp.heads_split:                       # every head of the DCP group: [T, W * H, R + Dr], rank order
        q_full = dcp.stack_gather(q_full).permute(1, 0, 2, 3).reshape(q_full.shape[0], dcp.size * h, -1)
    out, lse = partial_attention(q_full, rows, token_sequences(meta), allowed, scale=scale, latent_dim=r)
    out = combine(out, lse, dcp)                                              # [T, (W *) H, R]
    if dcp.heads_split:
        out = out[:, dcp.rank * h: (dcp.rank + 1) * h]                        # this rank's heads
    return torch.einsum("thr,hrv->thv", out, upcast(w_uv, cd)).to(q_nope.dtype)


def local_selection(indices: torch.Tensor, dcp: DecodeContextParallel, max_local: int) -> torch.Tensor:
    """bool [T, max_local]: the global top-k positions indices [T, k] (-1 padded) that this
    rank stores, at their local positions."""
    idx = indices.long()
    mine = (idx >= 0) & (idx % dcp.size == dcp.rank)
    local = torch.where(mine, idx // dcp.size, max_local).clamp(max=max_local)  # others -> spill column
    sel = torch.zeros(idx.shape[0], max_local + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(1, local, True)
    return sel[:, :max_local]
