"""Routed experts for prefill-sized batches: each active expert's MXFP4 weights dequantised to
bf16 by one Triton launch, then multiplied by the tokens routed to it on the vendor's bf16
matrix-product library (`moe_mxfp4.experts_forward`'s "dequant" mode).

Why: the in-kernel modes (moe_mxfp4.py) upcast the E2M1 codes inside every tile; at prefill
sizes (an 8K-token chunk of k3-slice routes ~1,000 tokens to each of 128 experts) that upcast
is repeated per token tile and the kernels run at ~19% of the H200's bf16 matrix-product rate.
Dequantising an expert costs its bf16 bytes once (66 MB at k3-slice's dimensions, ~20 us at
the copy bandwidth), after which cuBLAS multiplies at its own rate. Measured on the H200 at
k3-slice's dimensions (bench/moe_mxfp4.py): 56.0 ms at 8,192 tokens against 66.2 ms for the
64-token tiles, but 65.3 ms against 18.2 ms at 2,048: ~0.35 ms an expert whatever its tokens, so
the per-expert loop (about ten launches and a gather each) bounds it; batching the experts
(one dequantising launch for all, a grouped product) is the next step.

The rounding points are the model's dense FFN's (`k3.reference.glu_mlp`): the gate/up product,
the activation and the down product each rounded to bf16, products accumulated in fp32; the
bf16 weights are exact (every MXFP4 value times its E8M0 scale is a bf16). The k routed rows of a
token are weighted in fp32 and summed in a fixed order (no atomics), as the other modes.

The host reads how many tokens each expert got (one synchronisation per call): prefill is not
captured in a CUDA graph, and decode batches never take this mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.quant.mxfp4 import MXFP4Tensor

from . import glu
from .moe_mxfp4_common import e2m1_over_16384, e8m0_multiplier, pairs_by_local_expert

BLOCK_ROWS = 16
BLOCK_BYTES = 128           # 256 weights of a row per program (a multiple of a 16-byte scale group)


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, rows, s_pr, s_sr, s_or,
                       HALF_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """out[r, 2j] / out[r, 2j + 1] = low / high nibble of packed[r, j] times 2^(scale - 127) of
    its 32-column group, for BLOCK_ROWS rows x BLOCK_BYTES bytes per program."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = (r < rows)[:, None] & (j < HALF_COLS)[None, :]
    r64 = r.to(tl.int64)[:, None]
    packed = tl.load(packed_ptr + r64 * s_pr + j[None, :], mask=mask, other=0).to(tl.int32)   # [R, B]
    scale = tl.load(scales_ptr + r64 * s_sr + (j // 16)[None, :], mask=mask, other=127).to(tl.int32)
    mult = e8m0_multiplier(scale)
    lo = (e2m1_over_16384(packed & 15) * 16384.0) * mult
    hi = (e2m1_over_16384(packed >> 4) * 16384.0) * mult
    out = out_ptr + r64 * s_or + 2 * j[None, :]
    tl.store(out, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_expert(w: MXFP4Tensor, e: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Expert e of an [E, R, C] MXFP4Tensor as a dense [R, C] tensor of `dtype` (one launch)."""
    packed, scales = w.packed[e], w.scales[e]                       # [R, C/2] u8, [R, C/32] u8
    rows, half = packed.shape
    if packed.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("dequantize_expert: the packed codes and scales need contiguous rows")
    out = torch.empty(rows, 2 * half, dtype=dtype, device=packed.device)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(half, BLOCK_BYTES))
    _dequantize_kernel[grid](packed, scales, out, rows, packed.stride(0), scales.stride(0), out.stride(0),
                             HALF_COLS=half, BLOCK_ROWS=BLOCK_ROWS, BLOCK_BYTES=BLOCK_BYTES, num_warps=4)
    return out


def experts_forward(x, w13: MXFP4Tensor, w2: MXFP4Tensor, topk_weights, topk_ids, *, activation, beta=None,
                    linear_beta=None, expert_start=0):
    """`k3.reference.experts_forward` for bf16 activations over MXFP4 experts (its contract),
    one active expert at a time: dequantise w13[e], x[tokens of e] @ w13[e]^T, the gated
    activation (glu.py), dequantise w2[e], @ w2[e]^T, each rounded to bf16 (module docstring)."""
    t, l = x.shape
    e_local, topk = w13.shape[0], topk_ids.shape[1]
    local, order = pairs_by_local_expert(topk_ids, expert_start, e_local)            # pairs grouped by expert
    counts = torch.bincount(local, minlength=e_local + 1)[:e_local].tolist()           # the host synchronisation
    weights = topk_weights.reshape(-1).to(torch.float32)
    y = torch.zeros(t * topk, l, dtype=torch.float32, device=x.device)                # rows of other ranks stay 0
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start: start + count]                                           # [n] (token, choice) indices
        start += count
        h13 = x[pairs // topk] @ dequantize_expert(w13, e).T                          # [n, 2I] bf16
        a = glu.glu_activation(h13, activation=activation, beta=beta, linear_beta=linear_beta)   # [n, I]
        o = a @ dequantize_expert(w2, e).T                                            # [n, L] bf16
        y[pairs] = o.float() * weights[pairs, None]
    return y.view(t, topk, l).sum(1).to(x.dtype)
