"""Batch-invariant kernels in torch: every kernel entry computes each row from its own rows, in
an order fixed by the model's shapes alone, while taking many rows per call
(docs/batch-invariance.md). `k3.ops_helpers.invariant` holds the three constructions that make them so
(fixed-tree sums, fixed-shape GEMM row blocks, one implementation per transcendental
function); `invariant_tables()` is the full kernel set, what the reference platform serves in
the batch-invariant mode on the CPU and what a vendor plugin serves for the entries it has no
invariant kernel of its own for."""

from .tables import invariant_tables

__all__ = ["invariant_tables"]
