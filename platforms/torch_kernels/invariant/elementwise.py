"""Batch-invariant norms and activations (`ElementwiseKernels`, `k3.plugin.kernels.elementwise`):
the reference ops' formulas with every row reduction an `ordered_sum` and every transcendental
function a `pointwise` one, so a row's result is a function of that row alone."""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.plugin.kernels import NormedResidual

from k3.ops_helpers import invariant as p


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dimension, keepdim."""
    return p.rsqrt(p.ordered_sum(xf * xf, -1, keepdim=True) / xf.shape[-1] + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`RMSNorm`: normalise in fp32, cast, then x weight (K3's order)."""
    xf = x.to(compute_dtype(x))
    y = (xf * _inv_rms(xf, eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> NormedResidual:
    """`AddRMSNorm`: the residual sum rounded to residual.dtype, then `rms_norm` of it."""
    total = (residual + x).to(residual.dtype)
    return NormedResidual(rms_norm(total, weight, eps), total)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   activation: str = "sigmoid") -> torch.Tensor:
    """`GatedRMSNorm`: RMS_w(x) * act(gate), all in fp32, cast back once."""
    cd = compute_dtype(x, gate)
    xf = x.to(cd)
    y = xf * _inv_rms(xf, eps) * weight.to(cd)
    g = gate.to(cd)
    if activation == "sigmoid":
        y = y * p.sigmoid(g)
    elif activation in ("silu", "swish"):
        y = y * p.silu(g)
    else:
        raise ValueError(f"gated_rms_norm: unknown activation {activation!r} (sigmoid | silu)")
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`LayerNorm` in fp32: (x - mean) / sqrt(var + eps) * weight + bias (biased variance)."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    d = x.shape[-1]
    centred = xf - p.ordered_sum(xf, -1, keepdim=True) / d
    y = centred * p.rsqrt(p.ordered_sum(centred * centred, -1, keepdim=True) / d + eps)
    if weight is not None:
        y = y * weight.to(cd)
    if bias is not None:
        y = y + bias.to(cd)
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`L2Norm`: x / sqrt(sum(x^2) + eps) in fp32."""
    xf = x.to(compute_dtype(x))
    return (xf * p.rsqrt(p.ordered_sum(xf * xf, -1, keepdim=True) + eps)).to(x.dtype)


def glu_activation(x: torch.Tensor, *, activation: str, beta: float | None = None,
                   linear_beta: float | None = None) -> torch.Tensor:
    """`GLUActivation` of x [..., 2I] = [gate | up]: SiTU-GLU or SiLU-GLU in fp32, cast back once."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"glu_activation: x must be [..., 2I] ([gate | up]), got {tuple(x.shape)}")
    g, u = x.chunk(2, -1)
    cd = compute_dtype(x)
    gf, uf = g.to(cd), u.to(cd)
    if activation == "situ":
        if beta is None or not beta > 0 or (linear_beta is not None and not linear_beta > 0):
            raise ValueError(f"glu_activation: situ needs beta > 0 (K3: 4.0) and linear_beta > 0 or None; "
                             f"got {beta}, {linear_beta}")
        act = beta * p.tanh(gf / beta) * p.sigmoid(gf)
        lin = uf if linear_beta is None else linear_beta * p.tanh(uf / linear_beta)
        return (act * lin).to(x.dtype)
    if activation in ("silu", "swish"):
        return (p.silu(gf) * uf).to(x.dtype)
    raise ValueError(f"glu_activation: unknown activation {activation!r} (situ | silu)")


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`Sigmoid`: sigmoid(x) in the compute dtype."""
    return p.sigmoid(x.to(compute_dtype(x)))
