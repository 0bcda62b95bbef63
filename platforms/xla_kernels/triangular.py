"""The unit lower-triangular solve of KDA's WY/UT form without `torch.linalg.solve_triangular`
(which torch-xla 2.9 runs on the CPU, with a round trip per call): block forward substitution
over 16-row blocks, each diagonal block's inverse as a product of powers (the Neumann series of
a nilpotent matrix) refined by one Newton step, as the Triton kernel
`k3.platforms.triton_kernels.kda_intra_chunk` does. Only matmuls and slices of static shapes.
"""

from __future__ import annotations

import torch

BLOCK = 16


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for L [..., w, w] strictly lower triangular (w <= 16 or any w: the product runs
    until the power passes w): (I - L)(I + L^2)(I + L^4)... = sum_i (-L)^i, exact for a
    nilpotent L, then one Newton step X += X (I - (I + L) X) against the powers' rounding."""
    w = L.shape[-1]
    eye = torch.eye(w, dtype=L.dtype, device=L.device)
    power = -L
    inv = eye + power
    span = 2
    while span < w:
        power = power @ power                                               # (-L)^span
        inv = inv + inv @ power                                             # times (I + (-L)^span)
        span *= 2
    residual = eye - inv - L @ inv                                          # I - (I + L) inv
    return inv + inv @ residual


def unit_lower_solve(L: torch.Tensor, rhs: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """X with (I + L) X = rhs: L [..., C, C] strictly lower triangular (entries on or above the
    diagonal are never read), rhs [..., C, W]. Block forward substitution:
    X_i = D_i^-1 (rhs_i - sum_{j<i} L_ij X_j), D_i the unit lower diagonal block."""
    C = L.shape[-1]
    L = L.tril(-1)
    parts: list[torch.Tensor] = []
    for i0 in range(0, C, block):
        rows = slice(i0, min(i0 + block, C))
        r = rhs[..., rows, :]
        if parts:
            r = r - L[..., rows, :i0] @ torch.cat(parts, dim=-2)
        parts.append(unit_lower_inverse(L[..., rows, rows]) @ r)
    return torch.cat(parts, dim=-2)
