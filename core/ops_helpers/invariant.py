"""The three building blocks every batch-invariant kernel is made of (the kernels:
`k3.platforms.torch_kernels.invariant`; the mode: docs/batch-invariance.md).

A batch-invariant kernel computes each output row from its own input rows in an order fixed
by the model's shapes alone, never by how many rows share the call, where a row sits among
them, how a prompt was chunked or whether the row is a decode or a prefill token. These
blocks give that by construction:

- `ordered_sum`: a sum as a fixed binary tree of elementwise additions (the reduced length
  padded with zeros to a power of two, halves added until one is left). The tree depends on
  the reduced length only; an elementwise addition rounds each element on its own, so no
  thread count, vector width or batch shape can reorder it. Reductions over a growing length
  (attention over a context) add fixed-size blocks in position order (`KEY_BLOCK`): blocks
  past a row's own length add exact zeros.
- `linear`: x @ w^T as products of exactly ROW_BLOCK rows (the call's rows zero-padded): every
  product has the one shape [ROW_BLOCK, in] x [in, out] whatever the batch, so the GEMM library
  (MKL / oneDNN on the CPU, cuBLAS on CUDA: each bitwise reproducible for a given shape) picks
  the same algorithm, split and order every time, and a row's result does not depend on the
  other rows of its block (checked for position and companions by
  tests/unit/platform/test_invariant_kernels.py).
- `pointwise`: a transcendental elementwise function (exp, sigmoid, tanh, SiLU, softplus, log)
  computed by one implementation for every element. torch's CPU loops compute the vector-width
  body of a contiguous tensor with SIMD approximations and the tail (and each thread's chunk
  tail) with the scalar libm: the two differ in the last bit for sigmoid, SiLU and softplus, so
  an element's value would depend on where the batch put it. On the CPU the input is handed
  over as a stride-2 view, which torch's loops never vectorise: every element takes the scalar
  path. On other devices every element runs the same code already.

Plain +, -, *, /, sqrt, max and casts round each element exactly on every path and need none of
this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_BLOCK = 32          # rows per GEMM call (every dense product's one shape)
KEY_BLOCK = 64          # positions per attention / index-score block (reductions over a context)


def ordered_sum(x: torch.Tensor, dim: int = -1, *, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` as a fixed binary tree of elementwise additions (module docstring)."""
    dim = dim % x.dim()
    y = x.movedim(dim, -1)
    n = y.shape[-1]
    if n == 0:
        out = y.new_zeros(y.shape[:-1])
    else:
        width = 1 << (n - 1).bit_length()
        if width != n:
            y = F.pad(y, (0, width - n))
        while y.shape[-1] > 1:
            half = y.shape[-1] // 2
            y = y[..., :half] + y[..., half:]
        out = y[..., 0]
    return out.unsqueeze(dim) if keepdim else out


def ordered_dot(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """sum(a * b) over `dim` (broadcasting), the products rounded one by one, then `ordered_sum`."""
    return ordered_sum(a * b, dim)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a single elementwise torch function, every element by the same implementation
    (module docstring): on the CPU through a stride-2 copy of x (the scalar path)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    lanes = x.new_empty(x.numel(), 2)
    lanes[:, 0] = x.reshape(-1)
    return fn(lanes[:, 0]).view(x.shape)


def exp(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.exp, x)


def log(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.log, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.tanh, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(lambda v: F.softplus(v, beta=1.0, threshold=20.0), x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x): two correctly rounded operations (torch.rsqrt's CPU vector and scalar
    paths differ in bf16)."""
    return 1 / torch.sqrt(x)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T as F.linear computes it (x's dtype), in products of
    exactly ROW_BLOCK rows (module docstring). Returns [T, out]."""
    t = x.shape[0]
    blocks = -(-t // ROW_BLOCK)
    if blocks == 0:
        return F.linear(x, weight)
    padded = x.new_zeros(blocks * ROW_BLOCK, x.shape[1])
    padded[:t] = x
    out = torch.empty(blocks * ROW_BLOCK, weight.shape[0], dtype=torch.result_type(x, weight), device=x.device)
    for b in range(blocks):
        rows = slice(b * ROW_BLOCK, (b + 1) * ROW_BLOCK)
        out[rows] = F.linear(padded[rows], weight)
    return out[:t]


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over a short `dim` (experts, AttnRes sources): exact max, `exp`, `ordered_sum`."""
    e = exp(x - x.amax(dim, keepdim=True))
    return e / ordered_sum(e, dim, keepdim=True)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dimension: exact max, `exp`, `ordered_sum`, `log`.
    Rows that are all -inf give -inf."""
    m = x.amax(-1, keepdim=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (log(ordered_sum(exp(x - safe), -1, keepdim=True)) + safe)[..., 0]
