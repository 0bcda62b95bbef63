"""`scan(fn, carry, xs)`: a loop over the leading axis of `xs` threading `carry`, as
`torch_xla.experimental.scan.scan` on an XLA device (one traced body lowered to an XLA while
loop: the compile time does not grow with the number of steps) and a plain Python loop
elsewhere (the same function on the CPU, for the main-venv tests and the reference comparison).

fn(carry, x) -> (carry, y): carry and y pytrees (tuples) of tensors whose shapes do not change
from step to step, the carry floats only (the XLA scan traces it for gradients); `fn` must be
a pure module-level function that reads nothing but its arguments: torch-xla caches its traced
body per function and shapes (`is_fn_pure`), so a step traced once is reused by every call of
the same shapes. Returns (last carry, ys stacked along a new leading axis).
"""

from __future__ import annotations

import os

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# K3_TPU_SCAN=loop unrolls every scan into the graph (a debugging aid: compile time grows with the steps)
MODE = os.environ.get("K3_TPU_SCAN", "auto")
# up to this many steps the loop is unrolled on XLA too: torch-xla's scan traces its body with
# AOTAutograd (forward and backward) per new shape, which costs more than a few unrolled steps
UNROLL_STEPS = 4


def _device(tree) -> torch.device:
    leaves, _ = tree_flatten(tree)
    return next(t.device for t in leaves if isinstance(t, torch.Tensor))


def scan(fn, carry, xs):
    """(carry, ys): `fn` over xs's leading axis (see the module docstring)."""
    leaves, spec = tree_flatten(xs)
    if MODE != "loop" and _device(xs).type == "xla" and leaves[0].shape[0] > UNROLL_STEPS:
        from torch_xla.experimental.scan import scan as xla_scan

        return xla_scan(fn, carry, xs, is_fn_pure=True)
    ys = []
    for i in range(leaves[0].shape[0]):
        carry, y = fn(carry, tree_unflatten([x[i] for x in leaves], spec))
        ys.append(y)
    y_leaves, y_spec = tree_flatten(ys[0])
    stacked = [torch.stack([tree_flatten(y)[0][j] for y in ys]) for j in range(len(y_leaves))]
    return carry, tree_unflatten(stacked, y_spec)
