"""The graph's dense product, the oracle of `dense.linear`."""

from __future__ import annotations

import torch

from ..dtypes import compute_dtype


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Oracle of `Linear`: x [T, in] @ weight [out, in]^T in the compute dtype, cast to x.dtype."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"linear: x must be [T, in] and weight [out, in]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    cd = compute_dtype(x, weight)
    return (x.to(cd) @ weight.to(cd).T).to(x.dtype)
