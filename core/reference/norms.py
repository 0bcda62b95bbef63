"""Normalisations: RMSNorm (K3 convention), add + RMSNorm, gated RMSNorm, LayerNorm, L2 norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.plugin.kernels import NormedResidual

from ..dtypes import compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Oracle of `RMSNorm` (K3's `KimiRMSNorm` order: normalise in fp32, cast, then x weight)."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> NormedResidual:
    """Oracle of `AddRMSNorm`: the residual sum rounded to residual.dtype (the model's rounding
    point), then `rms_norm` of it. Returns (normed, residual')."""
    total = (residual + x).to(residual.dtype)
    return NormedResidual(rms_norm(total, weight, eps), total)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """Oracle of `GatedRMSNorm`: RMS_w(x) * act(gate), all in fp32, cast back once."""
    cd = compute_dtype(x, gate)
    xf = x.to(cd)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cd)
    g = gate.to(cd)
    if activation == "sigmoid":
        y = y * torch.sigmoid(g)
    elif activation in ("silu", "swish"):
        y = y * F.silu(g)
    else:
        raise ValueError(f"gated_rms_norm: unknown activation {activation!r} (sigmoid | silu)")
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Oracle of `LayerNorm`: torch's layer_norm in fp32."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    y = F.layer_norm(
        xf,
        (x.shape[-1],),
        None if weight is None else weight.to(cd),
        None if bias is None else bias.to(cd),
        eps,
    )
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Oracle of `L2Norm`: x / sqrt(sum(x^2) + eps) in fp32."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
