"""Compute-dtype rule shared by every reference op.

Reference ops compute in the dtype they are given, with one floor: half-precision inputs
(bf16, fp16) are computed in fp32, as every kernel accumulates them. float64 inputs stay
float64, which makes the reference the oracle kernels are checked against.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def upcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (no copy when it already is)."""
    return x if x.dtype == dtype else x.to(dtype)
