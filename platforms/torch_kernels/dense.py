"""The graph's dense product in torch: what the reference platform serves as `dense.linear`
(`k3.plugin.kernels.Linear`; `k3.reference.linear` is its oracle): torch's F.linear, which
accumulates half precision in fp32 and rounds once."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`Linear`: F.linear(x, weight)."""
    return F.linear(x, weight)
