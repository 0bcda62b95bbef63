"""KDA per-channel log-decay gate (k3-model-math.md 3.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import compute_dtype, upcast


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    *,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Oracle of `KDAGate`: the two gate formulas of the protocol, computed directly."""
    op = "kda_gate"
    if f.dim() < 2 or not f.is_floating_point():
        raise ValueError(
            f"{op}: f must be a float tensor [..., HV, K]; got {f.dtype} {tuple(f.shape)}"
        )
    HV, K = f.shape[-2:]
    if tuple(A_log.shape) not in ((HV,), (1, 1, HV, 1)):
        raise ValueError(
            f"{op}: A_log must be [HV] = [{HV}] (or legacy [1, 1, {HV}, 1]); "
            f"got {tuple(A_log.shape)}"
        )
    if dt_bias is not None and tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):
        raise ValueError(
            f"{op}: dt_bias must be [HV*K] = [{HV * K}] or [HV, K] = [{HV}, {K}]; "
            f"got {tuple(dt_bias.shape)}"
        )
    if lower_bound is not None and not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"{op}: lower_bound must be in [-5, 0); got {lower_bound}")
    cd = compute_dtype(f, A_log, dt_bias)
    x = upcast(f, cd)
    if dt_bias is not None:
        x = x + upcast(dt_bias, cd).reshape(HV, K)
    a = torch.exp(upcast(A_log, cd).reshape(HV, 1))  # [HV, 1], broadcast over channels
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)
