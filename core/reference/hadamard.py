"""Orthonormal Walsh-Hadamard transform (the DSA indexer's rotation before FP8)."""

from __future__ import annotations

import torch

from ..dtypes import compute_dtype


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """y = x H_n / sqrt(n) over the last axis, H_n the Sylvester Hadamard matrix.

    x: [..., n], n a power of two. H_n = [[H, H], [H, -H]] (natural order, as DeepSeek-V3.2's
    `fast_hadamard_transform`); H_n / sqrt(n) is symmetric and orthonormal, so the transform is
    its own inverse. Fast butterfly form: log2(n) passes of (a + b, a - b) over pairs whose
    indices differ in one bit. Computed in fp32 (fp64 for float64 input), returns x.dtype.
    """
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(
            f"hadamard_transform: x must be a float tensor [..., n]; got {x.dtype} {tuple(x.shape)}"
        )
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_transform: x must be [..., n] with n a power of two; got n={n}")
    y = x.to(compute_dtype(x)).reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)  # index bit of weight h -> axis 2
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        h *= 2
    return (y * n**-0.5).reshape(x.shape).to(x.dtype)
