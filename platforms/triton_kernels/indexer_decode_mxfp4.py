"""DSA indexer decode scores over MXFP4 index-key cache pages in Triton:
`IndexerKernels.paged_decode_scores` with fmt "mxfp4" (see k3.reference.indexer_paged_decode_scores).

An MXFP4 key is 68 bytes at D = 128 (k3.cache.records): D/2 bytes of E2M1 codes (element 2i in
the low nibble, element 2i+1 in the high one) and one E8M0 scale byte per 32 elements. The
reference dequantises every sequence's keys into a dense [N, max_pages * page, D] tensor; this
kernel reads each key's bytes once from its page, through the block table, and decodes them in
registers. Program (sequence n, block of BLOCK_L positions):

    bytes  = values[page(p), p % page, :]        uint8 [BLOCK_L, D/2]
    lo, hi = E2M1(bytes & 15), E2M1(bytes >> 4)  the even and odd elements, times 2^(e8m0 - 127)
                                                 of their 32-element block (exact in fp32)
    dots   = lo @ q8[n, :, 0::2]^T + hi @ q8[n, :, 1::2]^T     [BLOCK_L, Hi]
    score  = sum_h w[n, h] * relu(dots);   -inf at positions >= seq_lens[n]

The query is rounded to fp8 per (token, head) in torch first (as the reference does) and its
scale folded into the head weight; its even and odd dims are split in torch so the kernel never
interleaves nibbles. Every product (E2M1 x 2^k times an fp8 code) is exact in tf32, so the dots
differ from the reference only by the order of the fp32 sums. Scale byte 255 (NaN in E8M0, and
what poisoned pages hold) gives NaN as in the reference; byte 0 (2^-127, an fp32 subnormal) is
taken as 2^-127 only where the device keeps subnormals. float64 and other shapes go to the torch op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.dtypes import compute_dtype
from k3.ops_helpers import index_query
from k3.platforms.torch_kernels import indexer_paged_decode as torch_paged


@triton.jit
def _e2m1(code):
    """uint8 codes 0..15 -> fp32 E2M1 values: magnitude m = code & 7 is 0, .5, 1, 1.5, 2, 3, 4, 6."""
    m = (code & 7).to(tl.int32)
    e = m >> 1
    frac = (m & 1).to(tl.float32) * 0.5
    mag = tl.where(e == 0, frac, (1.0 + frac) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_scores_kernel(
    qe_ptr, qo_ptr, w_ptr, values_ptr, scales_ptr, table_ptr, lens_ptr, out_ptr,
    s_vp, s_vo, s_sp, s_so, s_bt, L,
    HI: tl.constexpr, HALF_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    heads = tl.arange(0, HI)
    cols = tl.arange(0, HALF_D)                                                         # byte j: elements 2j, 2j+1
    inside = pos < L
    valid = inside & (pos < tl.load(lens_ptr + n))
    page = tl.load(table_ptr + n * s_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
    off = pos % PAGE
    packed = tl.load(values_ptr + page[:, None] * s_vp + off[:, None] * s_vo + cols[None, :], mask=valid[:, None],
                     other=0)                                                           # uint8 [BLOCK_L, D/2]
    sbyte = tl.load(scales_ptr + page[:, None] * s_sp + off[:, None] * s_so + (cols // 16)[None, :],
                    mask=valid[:, None], other=127).to(tl.int32)                         # the byte's 32-block
    mult = tl.where(sbyte == 255, float("nan"),
                    tl.where(sbyte == 0, 5.877471754111438e-39,                          # 2^-127
                             (sbyte << 23).to(tl.float32, bitcast=True)))                # 2^(s - 127)
    lo = _e2m1(packed & 15) * mult                                                      # elements 2j
    hi = _e2m1(packed >> 4) * mult                                                      # elements 2j + 1
    qe = tl.load(qe_ptr + n * HI * HALF_D + heads[:, None] * HALF_D + cols[None, :])     # [HI, D/2] fp32
    qo = tl.load(qo_ptr + n * HI * HALF_D + heads[:, None] * HALF_D + cols[None, :])
    w = tl.load(w_ptr + n * HI + heads)                                                 # [HI]
    if IEEE:
        dots = tl.dot(lo, tl.trans(qe), input_precision="ieee")
        dots = tl.dot(hi, tl.trans(qo), dots, input_precision="ieee")
    else:
        dots = tl.dot(lo, tl.trans(qe), input_precision="tf32")                         # [BLOCK_L, HI]
        dots = tl.dot(hi, tl.trans(qo), dots, input_precision="tf32")
    score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1)
    tl.store(out_ptr + n * L + pos, tl.where(valid, score, float("-inf")), mask=inside)


def covers(q, head_weights, key_values, key_scales, fmt) -> bool:
    """The inputs this kernel computes; anything else goes to the torch op."""
    if fmt != "mxfp4" or q.dim() != 3 or key_values.dim() != 3 or key_scales.dim() != 3:
        return False
    hi, d = q.shape[1:]
    return (q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and head_weights.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and key_values.dtype == torch.uint8 and key_scales.dtype == torch.uint8
            and key_values.shape[2] * 2 == d and key_scales.shape[2] * 32 == d
            and key_values.stride(2) == 1 and key_scales.stride(2) == 1
            and hi >= 16 and d >= 32 and hi & (hi - 1) == 0 and d & (d - 1) == 0)


def paged_decode_scores(q, head_weights, key_values, key_scales, block_table, seq_lens, *, fmt, quantize_query=True,
                        block_l=64, ieee=None):
    """`k3.reference.indexer_paged_decode_scores` for MXFP4 pages in Triton (same signature and
    contract). block_l: positions per program (a launch option for benchmarks); ieee: IEEE fp32
    dots (None: for unquantised fp32 queries only; True where the target has no tf32, AMD's
    gfx950)."""
    if not covers(q, head_weights, key_values, key_scales, fmt) or block_table.dim() != 2 \
            or block_table.shape[0] != q.shape[0]:
        return torch_paged.indexer_paged_decode_scores(q, head_weights, key_values, key_scales, block_table, seq_lens,
                                                       fmt=fmt, quantize_query=quantize_query)
    n, hi, d = q.shape
    cd = compute_dtype(q, head_weights)                   # fp32 here (float64 went to the torch op)
    qc, w = index_query(q, head_weights, quantize_query=quantize_query, dtype=cd)
    pages, page = block_table.shape[1], key_values.shape[1]
    length = pages * page
    out = torch.empty(n, length, dtype=cd, device=q.device)
    if n and length:
        _mxfp4_scores_kernel[(n, triton.cdiv(length, block_l))](
            qc[..., 0::2].contiguous(), qc[..., 1::2].contiguous(), w.contiguous(), key_values, key_scales,
            block_table, seq_lens, out,
            key_values.stride(0), key_values.stride(1), key_scales.stride(0), key_scales.stride(1),
            block_table.stride(0), length,
            HI=hi, HALF_D=d // 2, PAGE=page, BLOCK_L=block_l,
            IEEE=(not quantize_query and q.dtype == torch.float32) if ieee is None else bool(ieee),
        )
    return out
