"""The orthonormal Walsh-Hadamard transform as log2(n) butterfly passes: what the reference
platform serves as `indexer.hadamard`. `k3.plugin.kernels.HadamardTransform` is the contract;
`k3.reference.hadamard_transform`, a product with the explicit Sylvester matrix, is its oracle.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """`HadamardTransform`: pass h adds and subtracts the pairs whose indices differ in bit h."""
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
