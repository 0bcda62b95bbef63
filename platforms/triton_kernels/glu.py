"""The GLU activation of K3's dense FFNs (shared experts, the first dense layers) as one Triton
kernel: `ElementwiseKernels.glu_activation` (see k3.reference.glu_activation for the contract:
[gate | up] in, SiTU-GLU or SiLU-GLU in fp32, rounded once to x's dtype).

Why: the reference op is about ten launches (two casts, the two softcaps' divide, tanh and
multiply, the sigmoid, the products, the cast back), run for the shared expert of every k3-slice
layer in each decode step. One program per (row, block of columns) reads the gate and up
halves once and writes the product once; the activation itself is the MoE kernels' own
(moe_mxfp4_common.gated_activation), so the dense and routed experts compute the same function.
Inputs the kernel does not cover (float64, a last axis that is not contiguous) run the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref

from .moe_mxfp4_common import gated_activation

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024


@triton.jit
def _glu_kernel(x_ptr, out_ptr, s_x, s_out, beta, linear_beta, I: tl.constexpr, BLOCK_I: tl.constexpr,
                SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    g = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * s_x + I + cols, mask=mask, other=0.0)
    out = gated_activation(g.to(tl.float32), u.to(tl.float32), beta, linear_beta, SITU, HAS_LINEAR_BETA)
    tl.store(out_ptr + row * s_out + cols, out.to(g.dtype), mask=mask)


def covers(x, activation) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    return (x.dtype in _ACTIVATIONS and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and activation in ("situ", "silu", "swish"))


def glu_activation(x: torch.Tensor, *, activation: str, beta: float | None = None,
                   linear_beta: float | None = None) -> torch.Tensor:
    """`k3.reference.glu_activation` in one launch (same signature, contract and errors)."""
    situ = activation == "situ"
    if not covers(x, activation) or (situ and (beta is None or not beta > 0
                                               or (linear_beta is not None and not linear_beta > 0))):
        return ref.glu_activation(x, activation=activation, beta=beta, linear_beta=linear_beta)
    two_i = x.shape[-1]
    rows = x.reshape(-1, two_i) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        return ref.glu_activation(x, activation=activation, beta=beta, linear_beta=linear_beta)
    inter = two_i // 2
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if rows.shape[0] and inter:
        block = min(BLOCK, max(16, triton.next_power_of_2(inter)))
        _glu_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), float(beta or 1.0), float(linear_beta or 1.0),
            I=inter, BLOCK_I=block, SITU=situ, HAS_LINEAR_BETA=situ and linear_beta is not None, num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)
