"""The torch-native experts' pieces that never synchronise with the host (decode, graph
capture): the device-side sort of (token, slot) pairs by expert, and the slot-dense product
for devices without a usable grouped GEMM (or MXFP4 experts, dequantised on the fly).

Slot-dense: the n = min(T k, E_local) expert slots a step can touch, each applied to every one
of the T tokens as one batched product and masked by the routing:
- n == E_local (T k >= E_local, e.g. 16+ decode tokens at top-16 of 128): slot i is expert i,
  so dense stacks are used in place (no copy) and MXFP4 ones are dequantised from a slice;
- n < E_local (a few tokens): the experts any pair names come first (a stable device sort of
  "unused" flags), so the n slots hold every routed expert and nothing is read on the host;
  their weights are gathered (dense) or dequantised (MXFP4) into the workspace.
Slots are walked g at a time (`Materialiser`: the workspace holds g experts); a token's weight
for a slot sums its pairs on that expert (repeated ids add up, as the oracle's loop does), and
tokens that route nowhere on a slot are masked out (0 * NaN from an unused expert never
reaches the sum). The waste is T rows per slot against the ~T k / E_local the routing sends
there: compute only, the bytes read are the weights (the bound here).
"""

from __future__ import annotations

import torch

from k3.quant.mxfp4 import MXFP4Tensor

from .mxfp4_lut import lut_dequantize
from .split_products import batched_split_product


def sort_pairs(local: torch.Tensor, e_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [M], counts [E_local + 1]) for local expert ids `local` [M] (any int; ids outside
    [0, E_local) are other ranks' and go to a sentinel bucket E_local at the end): the pairs in
    expert order (stable), and each expert's pair count. On the device, no host read."""
    key = torch.where((local >= 0) & (local < e_local), local, e_local)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e_local + 1, dtype=torch.long, device=local.device).scatter_add_(0, key, torch.ones_like(key))
    return order, counts


class Materialiser:
    """Dense weights of a run of expert slots in the compute dtype: a view of a dense stack,
    a gather of it, or MXFP4 dequantised (`lut_dequantize`) into `buffer` ([g, R, C], reused)."""

    def __init__(self, w, buffer: torch.Tensor | None, dtype: torch.dtype, fused=None):
        self.w, self.buffer, self.dtype, self.fused = w, buffer, dtype, fused    # fused: lut_dequantize's

    def __call__(self, start: int, stop: int, index: torch.Tensor | None) -> torch.Tensor:
        """Experts start..stop (index None) or index [stop - start] as [stop - start, R, C]."""
        n, w = stop - start, self.w
        if isinstance(w, MXFP4Tensor):
            return lut_dequantize(w, self.buffer[:n], start=start, index=index, fused=self.fused)
        if index is None:
            return w[start:stop].to(self.dtype)
        if w.dtype == self.dtype:
            return torch.index_select(w, 0, index, out=self.buffer[:n])
        return w.index_select(0, index).to(self.dtype)


def slot_experts(xf: torch.Tensor, local: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, *,
                 e_local: int, g: int, w13: Materialiser, w2: Materialiser, glu) -> torch.Tensor:
    """Slot-dense experts (module docstring): out [T, L] += sum over slots of the masked,
    weighted expert outputs. xf [T, L] holds the operands (the materialised weights' dtype:
    bf16 or the compute dtype), weights [T, k] and out the compute dtype, local [T, k] local
    expert ids (others out of range). Products are taken to the compute dtype for the GLU and the
    sum; on bf16 operands the down product splits the activation (`split_products`). Returns out."""
    t, k = local.shape
    n = min(t * k, e_local)
    slots = None                                                      # slot i is expert i
    if n < e_local:
        valid = (local >= 0) & (local < e_local)
        counts = torch.zeros(e_local, dtype=torch.int32, device=xf.device).scatter_add_(
            0, torch.where(valid, local, 0).reshape(-1), valid.reshape(-1).to(torch.int32))
        slots = torch.argsort((counts == 0).to(torch.int32), stable=True)[:n]   # routed experts first
    for s0 in range(0, n, g):
        s1 = min(n, s0 + g)
        experts = torch.arange(s0, s1, device=xf.device) if slots is None else slots[s0:s1]    # [g]
        hit = local[None] == experts[:, None, None]                                # [g, T, k]
        member = hit.any(-1)                                                       # [g, T]
        gate = (hit.to(weights.dtype) * weights[None]).sum(-1)                     # [g, T]
        index = None if slots is None else experts
        h = torch.matmul(xf, w13(s0, s1, index).transpose(1, 2)).to(out.dtype)     # [g, T, 2I]
        w2_t = w2(s0, s1, index).transpose(1, 2)                                   # [g, I, L]
        a = glu(h)                                                                 # [g, T, I]
        o = batched_split_product(a, w2_t) if w2_t.dtype != a.dtype else torch.matmul(a, w2_t)   # [g, T, L]
        out += torch.where(member[..., None], o * gate[..., None], 0).sum(0)
    return out
