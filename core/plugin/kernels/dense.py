"""Dense product kernel entries: `DenseKernels`."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Linear(Protocol):
    """`dense.linear`: the graph's weight products (every projection and the LM head):
    x `[T, in]` @ weight `[out, in]`^T -> `[T, out]` in x's dtype (weight of the same dtype),
    products and sums in at least fp32 and rounded once, as torch's F.linear does. Each output
    row depends on its input row alone (the batch-invariant mode asks for the same bits
    whatever rows share the call: docs/batch-invariance.md)."""

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor: ...
