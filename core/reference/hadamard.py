"""The orthonormal Walsh-Hadamard transform (the DSA indexer's rotation before FP8), the oracle:
a product with the explicit Sylvester matrix. The contract is
`k3.plugin.kernels.HadamardTransform`; the reference platform serves the butterfly form of
`k3.platforms.torch_kernels.hadamard`."""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype


def sylvester(n: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """H_n [n, n] in natural order: H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Oracle of `HadamardTransform`: x H_n / sqrt(n) (H_n is symmetric)."""
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(
            f"hadamard_transform: x must be a float tensor [..., n]; got {x.dtype} {tuple(x.shape)}"
        )
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_transform: x must be [..., n] with n a power of two; got n={n}")
    cd = compute_dtype(x)
    return (x.to(cd) @ sylvester(n, cd, x.device) * n**-0.5).to(x.dtype)
