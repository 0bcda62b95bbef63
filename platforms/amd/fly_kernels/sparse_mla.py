"""Sparse (DSA) absorbed MLA decode over bf16 latent pages in FlyDSL: `mla.decode` with
`topk_indices` on AMD Instinct (gfx942 / gfx950). **Never executed** (no AMD GPU has been
reachable): lowered to AMDGCN in CI (tests/kernels/test_amd_flydsl.py), served only when
K3_AMD_FLYDSL=1 on a ROCm device (k3.platforms.amd.kernels), marked unverified in docs/amd.md.

The weight absorptions stay batched products in torch (q_nope w_uk before, the latent output
times w_uv after), as in the Triton kernel; the selection is resolved in torch first
(k3.platforms.torch_kernels.mla_selection: each position once, then positions past the query's
causal end dropped and the rest mapped through the block table to cache rows, -1 for none).
Program (query token t, 4 heads): one wavefront per head; lane l holds the query's latent dims
8l .. 8l + 7 (R = 512) and rope dim l (Dr = 64), scaled by softmax_scale * log2(e). For each
selected row the wave reads the row once (8 + 1 values a lane), sums its lanes' partial dot
products by xor shuffles (every lane gets the score) and keeps an online softmax in base 2
(running max, running sum, 8 latent accumulators a lane); a wave whose rows are all -1 writes
zeros, as the reference's softmax over nothing. Output: the latent [T, H, R] in fp32.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl.expr import range_constexpr
from flydsl.expr.typing import Vector

WAVE = 64                  # lanes of a CDNA wavefront
HEADS = 4                  # heads (wavefronts) per workgroup
LOG2E = 1.4426950408889634


@flyc.kernel
def sparse_mla_kernel(Q: fx.Tensor, KV: fx.Tensor, Rows: fx.Tensor, Out: fx.Tensor, H: fx.Int32, NSEL: fx.Int32,
                      scale: fx.Float32, R: fx.Constexpr[int], DR: fx.Constexpr[int]):
    """Out [T, H, R] fp32 from Q [T, H, R + DR] fp32 (absorbed query | rope query), KV
    [rows, R + DR] bf16 latent rows and Rows [T, NSEL] int32 (cache row of each selected
    position, -1 for none). Every tensor flat (1-D): see moe_w4a16.mxfp4_gemv_kernel."""
    d = R + DR
    per_lane = R // WAVE
    t = fx.block_idx.x
    lane = fx.thread_idx.x % WAVE
    h = fx.block_idx.y * HEADS + fx.thread_idx.x // WAVE
    live = h < H
    q_at = (t * H + live.select(h, 0)) * d
    qs = scale * LOG2E                                                    # scores in base 2
    q_lat = Vector.from_elements([fx.memref_load(Q, q_at + lane * per_lane + i) * qs
                                  for i in range_constexpr(per_lane)], fx.Float32)
    q_pe = fx.memref_load(Q, q_at + R + lane) * qs
    m = fx.Float32(float("-inf"))
    total = fx.Float32(0.0)
    acc = Vector.filled([per_lane], 0.0, fx.Float32)
    for j in range(0, NSEL, 1):
        row = fx.memref_load(Rows, t * NSEL + j)
        valid = row >= 0
        at = valid.select(row, 0) * d
        kv = Vector.from_elements([fx.memref_load(KV, at + lane * per_lane + i).to(fx.Float32)
                                   for i in range_constexpr(per_lane)], fx.Float32)
        part = (q_lat * kv).reduce(fx.ReductionOp.ADD) + q_pe * fx.memref_load(KV, at + R + lane).to(fx.Float32)
        for s in range_constexpr(6):                                      # log2(64) xor-shuffle rounds
            part = part + part.shuffle_xor(WAVE >> (s + 1), WAVE)
        score = valid.select(part, float("-inf"))
        m_new = fx.max(m, score)
        seen = m_new > float("-inf")                                      # some valid row so far
        alpha = seen.select(fx.math.exp2(m - m_new), 1.0)
        p = seen.select(fx.math.exp2(score - m_new), 0.0)
        total = total * alpha + p
        acc = acc * alpha + kv * p
        m = m_new
    out = acc * (total > 0.0).select(1.0 / total, 0.0)
    if live:
        for i in range_constexpr(per_lane):
            fx.memref_store(out[i], Out, (t * H + h) * R + lane * per_lane + i)


@flyc.jit
def sparse_mla(Q: fx.Tensor, KV: fx.Tensor, Rows: fx.Tensor, Out: fx.Tensor, T: fx.Int32, H: fx.Int32,
               NSEL: fx.Int32, scale: fx.Float32, R: fx.Constexpr[int], DR: fx.Constexpr[int],
               stream: fx.Stream = fx.Stream(None)):
    """Launch `sparse_mla_kernel` over T queries x ceil(H / HEADS) head groups."""
    sparse_mla_kernel(Q, KV, Rows, Out, H, NSEL, scale, R, DR).launch(
        grid=(T, (H + HEADS - 1) // HEADS, 1), block=(HEADS * WAVE, 1, 1), stream=stream)


def covers(q_nope, q_pe, kv_cache, w_uk, topk_indices) -> bool:
    """Inputs this kernel computes: a DSA selection over bf16 pages on a ROCm device, R = 8 x 64
    and Dr = 64 (K3.1 Pro's 512 + 64)."""
    return (topk_indices is not None and q_nope.is_cuda and kv_cache.dtype == torch.bfloat16
            and w_uk.shape[-1] == 8 * WAVE and q_pe.shape[-1] == WAVE and kv_cache.stride(-1) == 1)


def cache_rows(selection, block_table, seq_of, q_pos, page: int) -> torch.Tensor:
    """int32 [T, k]: the cache row (page * page_size + offset) of each selected position, -1 for
    padding and positions after the query (causal end min(seq_len, q_pos + 1) is applied by
    the caller through q_pos)."""
    pos = selection.long()
    valid = (pos >= 0) & (pos <= q_pos[:, None])
    safe = torch.where(valid, pos, 0)
    rows = block_table.long()[seq_of[:, None], safe // page] * page + safe % page
    return torch.where(valid, rows, -1).to(torch.int32)


def mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, *, scale, cu_seqlens_q=None,
               kv_cache_scale=None, topk_indices=None, fallback=None):
    """`k3.reference.mla_decode` (same signature and contract) for DSA selections over bf16
    pages; anything `covers` refuses goes to `fallback` (the amd plugin's Triton entry)."""
    from k3.platforms.torch_kernels.mla_selection import query_positions, unique_selection

    if not covers(q_nope, q_pe, kv_cache, w_uk, topk_indices):
        return fallback(q_nope, q_pe, kv_cache, block_table, seq_lens, w_uk, w_uv, scale=scale,
                        cu_seqlens_q=cu_seqlens_q, kv_cache_scale=kv_cache_scale, topk_indices=topk_indices)
    t, h, _ = q_nope.shape
    r, dr = w_uk.shape[-1], q_pe.shape[-1]
    page = kv_cache.shape[1]
    seq_of, q_pos = query_positions(t, seq_lens, cu_seqlens_q)
    q_pos = torch.minimum(q_pos, seq_lens.long()[seq_of] - 1)
    rows = cache_rows(unique_selection(topk_indices, block_table.shape[1] * page), block_table, seq_of, q_pos, page)
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float())                   # [T, H, R] fp32
    q_full = torch.cat([q_lat, q_pe.float()], -1).contiguous()                           # [T, H, R + Dr]
    out = torch.empty(t, h, r, dtype=torch.float32, device=q_nope.device)
    if t:
        sparse_mla(q_full.view(-1), kv_cache.reshape(-1), rows.view(-1), out.view(-1), t, h, rows.shape[1],
                   float(scale), r, dr)
    return torch.einsum("thr,hrv->thv", out, w_uv.float()).to(q_nope.dtype)


def example_args(tokens: int = 2, heads: int = 16, selected: int = 64, rows: int = 256, r: int = 512,
                 dr: int = 64) -> tuple:
    """Arguments of `sparse_mla` at K3.1 Pro's latent widths, flat CPU placeholders (for lowering)."""
    return (torch.empty(tokens * heads * (r + dr)), torch.empty(rows * (r + dr), dtype=torch.bfloat16),
            torch.empty(tokens * selected, dtype=torch.int32), torch.empty(tokens * heads * r), tokens, heads,
            selected, 0.0625, r, dr)
