"""LoRA kernel entries (multi-adapter batches): `LoRAKernels`.

Adapters live in slots: A `[S, R, in]`, B `[S, out, R]` and a scale per slot `[S]`; an adapter
of rank r < R is zero-padded. Every token row names its slot, `indices` int `[T]`, -1 for none:
a row without an adapter gets exactly zero (the base model's output, bit for bit, once added).
Routed-expert adapters stack per local expert: A `[S, E_local, R, in]`, B `[S, E_local, rows, R]`.
Neither entry may read a device value on the host (graph capture, decode).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from k3.quant.mxfp4 import MXFP4Tensor


class LoRADelta(Protocol):
    """`lora.delta`: delta[t] = scales[i] * B[i] (A[i] x[t]), i = indices[t]; zero where i < 0.

    x `[T, in]`; a `[S, R, in]`; b `[S, out, R]`; scales `[S]`; indices int `[T]`. Computed in the
    compute dtype of x, a and b and returned in it `[T, out]` (the caller adds it to its product
    and rounds once)."""

    def __call__(self, x: Tensor, a: Tensor, b: Tensor, scales: Tensor, indices: Tensor) -> Tensor: ...


class LoRAExperts(Protocol):
    """`lora.experts`: `moe.experts` with per-expert adapters: each chosen expert e of token t
    computes act((W13_e + s B13 A13) x[t]) then (W2_e + s B2 A2) a, s and the adapters those of
    slot indices[t] (none for -1), weighted by topk_weights and summed.

    x, w13, w2, topk_weights, topk_ids, activation, beta, linear_beta, expert_start as
    `moe.experts`; indices int `[T]`; w13_lora / w2_lora: lists of (rows of the weight's output
    the adapter writes, A `[S, E_local, R, in]`, B `[S, E_local, rows, R]`); scales `[S]`.
    Returns `[T, L]` x.dtype, this rank's partial sum."""

    def __call__(self, x: Tensor, w13: Tensor | MXFP4Tensor, w2: Tensor | MXFP4Tensor, topk_weights: Tensor,
                 topk_ids: Tensor, indices: Tensor, *, w13_lora: list, w2_lora: list, scales: Tensor,
                 activation: str, beta: float | None = None, linear_beta: float | None = None,
                 expert_start: int = 0) -> Tensor: ...
