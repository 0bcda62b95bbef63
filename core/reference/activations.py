"""GLU activations of K3's FFNs: SiTU (Sigmoid-Tanh Unit) and SiLU (SwiGLU).

    softcap_b(x)   = b * tanh(x / b)
    SiTU_b(g)      = softcap_b(g) * sigmoid(g)
    SiTU-GLU(g, u) = SiTU_beta(g) * softcap_linear_beta(u)      (linear_beta None: * u)

K3 uses beta = 4, linear_beta = 25 (config `activation_situ_beta`,
`activation_situ_linear_beta`), so |SiTU-GLU| < 100. There is deliberately no default beta:
libraries that fall back to `beta or 1.0` compute the wrong function for K3.
The input of a GLU is the concatenated projection `[gate | up]` (first half gate).
All math in fp32 (float64 stays float64); results are cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import compute_dtype


def _check_beta(name: str, value: float | None, *, optional: bool) -> None:
    if value is None:
        if not optional:
            raise ValueError(f"{name} is required (K3: activation_situ_beta = 4.0); there is no default")
        return
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (or None for no cap), got {value}")


def _split_glu(fn: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"{fn}: x must be [..., 2I] ([gate | up]), got {tuple(x.shape)}")
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def situ(g: torch.Tensor, *, beta: float) -> torch.Tensor:
    """Elementwise SiTU_beta(g) = beta * tanh(g / beta) * sigmoid(g).

    g: any shape, float. Computed in fp32 (fp64 for float64); returns g.dtype.
    """
    _check_beta("situ: beta", beta, optional=False)
    cd = compute_dtype(g)
    gf = g.to(cd)
    return (beta * torch.tanh(gf / beta) * torch.sigmoid(gf)).to(g.dtype)


def situ_glu(x: torch.Tensor, *, beta: float, linear_beta: float | None = None) -> torch.Tensor:
    """SiTU-GLU of x [..., 2I] = [gate | up] -> [..., I] of x.dtype.

    out = beta*tanh(g/beta)*sigmoid(g) * (linear_beta*tanh(u/linear_beta) if linear_beta is
    not None else u). Computed in fp32 (fp64 for float64), cast back once.
    """
    _check_beta("situ_glu: beta", beta, optional=False)
    _check_beta("situ_glu: linear_beta", linear_beta, optional=True)
    g, u = _split_glu("situ_glu", x)
    cd = compute_dtype(x)
    gf, uf = g.to(cd), u.to(cd)
    act = beta * torch.tanh(gf / beta) * torch.sigmoid(gf)  # [..., I]
    lin = uf if linear_beta is None else linear_beta * torch.tanh(uf / linear_beta)
    return (act * lin).to(x.dtype)


def silu_glu(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of x [..., 2I] = [gate | up]: silu(g) * u -> [..., I] of x.dtype.

    Computed in fp32 (fp64 for float64), cast back once. (Kimi-Linear's FFN activation.)
    """
    g, u = _split_glu("silu_glu", x)
    cd = compute_dtype(x)
    return (F.silu(g.to(cd)) * u.to(cd)).to(x.dtype)


def glu_activation(
    x: torch.Tensor, *, activation: str, beta: float | None = None, linear_beta: float | None = None
) -> torch.Tensor:
    """Oracle of `GLUActivation`: "situ" -> `situ_glu(beta, linear_beta)` (beta required),
    "silu" / "swish" -> `silu_glu`."""
    if activation == "situ":
        if beta is None:
            raise ValueError("glu_activation: beta is required for activation='situ' (K3: 4.0)")
        return situ_glu(x, beta=beta, linear_beta=linear_beta)
    if activation in ("silu", "swish"):
        return silu_glu(x)
    raise ValueError(f"glu_activation: unknown activation {activation!r} (situ | silu)")


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Oracle of `Sigmoid`: torch.sigmoid in the compute dtype (fp32; fp64 for float64)."""
    return torch.sigmoid(x.to(compute_dtype(x)))
