"""K3's RMSNorm as one Triton kernel: `ElementwiseKernels.rms_norm` (see k3.reference.rms_norm
for the contract: normalise in fp32, round to x's dtype, then multiply by the weight in x's dtype).

Why: the reference op is six launches (cast, square, mean, rsqrt, multiply, cast) and a seventh
for the weight; a k3-slice decode step runs 19 of these norms (MLA's two latent norms, the
LatentMoE norm of every layer, the final norm), about 0.45 ms of a 8.4 ms step on the H200
(bench/k3_slice_profile.py), and each launch is a node the decode graph replays. One program per
row reads the row once, reduces it in fp32 and writes it once.

Rows may be strided (MLA normalises the first 512 columns of its 576-wide latent row in place of
a copy); the last axis must be contiguous. float64 and anything else the kernel does not cover
run the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_x, s_out, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / D
    y = (xf * tl.math.rsqrt(mean_square + eps)).to(x.dtype)        # rounded as the reference does
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(x.dtype)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype)       # x.dtype * x.dtype, rounded once
    tl.store(out_ptr + row * s_out + cols, y, mask=mask)


def covers(x, weight) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    return (x.dtype in _ACTIVATIONS and x.dim() >= 1 and x.stride(-1) == 1 and x.shape[-1] <= 16384
            and (weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1])))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`k3.reference.rms_norm` in one launch (same signature and contract). x [..., D] -> x.dtype."""
    if not covers(x, weight):
        return ref.rms_norm(x, weight, eps)
    d = x.shape[-1]
    rows = x.reshape(-1, d) if x.dim() != 2 else x     # a view where the leading axes allow one
    if rows.stride(-1) != 1:
        return ref.rms_norm(x, weight, eps)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    weight = weight.contiguous() if weight is not None else None
    block = max(16, triton.next_power_of_2(d))
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight if weight is not None else rows, out, rows.stride(0), out.stride(0), float(eps),
        D=d, BLOCK_D=block, HAS_WEIGHT=weight is not None, num_warps=min(16, max(1, block // 256)),
    )
    return out.view(x.shape)
