"""DSA indexer decode scores over the fp8 index-key cache pages in Triton:
`IndexerKernels.paged_decode_scores` (see k3.reference.indexer_paged_decode_scores).

The reference gathers every sequence's pages, dequantises all their keys into a dense
[N, max_pages * page, D] tensor and scores that; this kernel reads each fp8 key row once from
its page, through the block table, and never materialises the keys. Program (sequence n,
block of BLOCK_L positions):

    keys  = values[page(p), p % page, :]      fp8 [BLOCK_L, D] -> fp32 (exact)
    dots  = keys @ q8[n]^T                    [BLOCK_L, Hi], tf32 products (exact: fp8 codes
                                              times fp8 codes) or IEEE for unquantised fp32 q
    score = sum_h w[n, h] * relu(dots * key_scale)
    score = -inf at positions >= seq_lens[n]

The query is rounded to fp8 per (token, head) in torch first (as the reference does) and its
scale folded into the head weight, so the kernel multiplies fp8 codes only. Each key's fp32
scale multiplies its dot after the sum instead of every element before it: the same products,
rounded once more or less (fp32 tolerance). MXFP4 pages go to `indexer_decode_mxfp4` (its own
kernel); float64 goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.dtypes import compute_dtype
from k3.ops_helpers import index_query
from k3.platforms.torch_kernels import indexer_paged_decode as torch_paged

from . import indexer_decode_mxfp4


@triton.jit
def _paged_scores_kernel(
    q_ptr, w_ptr, values_ptr, scales_ptr, table_ptr, lens_ptr, out_ptr,
    s_vp, s_vo, s_sp, s_so, s_bt, L,
    HI: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    heads = tl.arange(0, HI)
    dims = tl.arange(0, D)
    inside = pos < L
    valid = inside & (pos < tl.load(lens_ptr + n))
    page = tl.load(table_ptr + n * s_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
    off = pos % PAGE
    keys = tl.load(values_ptr + page[:, None] * s_vp + off[:, None] * s_vo + dims[None, :], mask=valid[:, None],
                   other=0.0).to(tl.float32)                                           # [BLOCK_L, D]
    key_scale = tl.load(scales_ptr + page * s_sp + off * s_so, mask=valid, other=0.0)    # [BLOCK_L]
    q = tl.load(q_ptr + n * HI * D + heads[:, None] * D + dims[None, :])                 # [HI, D] fp32
    w = tl.load(w_ptr + n * HI + heads)                                                  # [HI]
    if IEEE:
        dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
    else:
        dots = tl.dot(keys, tl.trans(q), input_precision="tf32")                         # [BLOCK_L, HI]
    score = tl.sum(tl.maximum(dots * key_scale[:, None], 0.0) * w[None, :], 1)
    tl.store(out_ptr + n * L + pos, tl.where(valid, score, float("-inf")), mask=inside)


def covers(q, head_weights, key_values, key_scales, fmt) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    if fmt != "fp8" or q.dim() != 3 or key_values.dim() != 3 or key_scales.dim() != 2:
        return False
    hi, d = q.shape[1:]
    return (q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and head_weights.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and key_values.dtype == torch.float8_e4m3fn and key_scales.dtype == torch.float32
            and key_values.shape[2] == d and key_values.stride(2) == 1
            and hi >= 16 and d >= 16 and hi & (hi - 1) == 0 and d & (d - 1) == 0)


def paged_decode_scores(q, head_weights, key_values, key_scales, block_table, seq_lens, *, fmt, quantize_query=True,
                        block_l=64, ieee=None):
    """`k3.reference.indexer_paged_decode_scores` in Triton (same signature and contract).

    block_l: positions per program (a launch option for benchmarks). ieee: IEEE fp32 dots (None:
    for unquantised fp32 queries, tf32 otherwise, exact for fp8 codes; True where the target has
    no tf32, AMD's gfx950): a launch option for platform tables. MXFP4 pages:
    `indexer_decode_mxfp4.paged_decode_scores`.
    """
    if fmt == "mxfp4":
        return indexer_decode_mxfp4.paged_decode_scores(q, head_weights, key_values, key_scales, block_table,
                                                        seq_lens, fmt=fmt, quantize_query=quantize_query,
                                                        block_l=block_l, ieee=ieee)
    if not covers(q, head_weights, key_values, key_scales, fmt) or block_table.dim() != 2 \
            or block_table.shape[0] != q.shape[0]:
        return torch_paged.indexer_paged_decode_scores(q, head_weights, key_values, key_scales, block_table, seq_lens,
                                               fmt=fmt, quantize_query=quantize_query)
    n, hi, d = q.shape
    cd = compute_dtype(q, head_weights)                   # fp32 here (float64 went to the reference)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    pages, page = block_table.shape[1], key_values.shape[1]
    length = pages * page
    out = torch.empty(n, length, dtype=cd, device=q.device)
    if n and length:
        _paged_scores_kernel[(n, triton.cdiv(length, block_l))](
            qc.contiguous(), w.contiguous(), key_values, key_scales, block_table, seq_lens, out,
            key_values.stride(0), key_values.stride(1), key_scales.stride(0), key_scales.stride(1),
            block_table.stride(0), length,
            HI=hi, D=d, PAGE=page, BLOCK_L=block_l, IEEE=(not quantize_query and q.dtype == torch.float32) if ieee is None else bool(ieee),
        )
    return out
