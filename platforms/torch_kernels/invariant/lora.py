"""Batch-invariant LoRA (`LoRAKernels`, `k3.plugin.kernels.lora`): the reference's shrink and
expand per slot, each a ROW_BLOCK-row GEMM (`k3.ops_helpers.invariant.linear`), so a row's delta depends on
its own row and slot only; rows of other slots add exact zeros. The routed experts with adapters
are `invariant.moe.run_experts` with this delta."""

from __future__ import annotations

import torch

from k3.ops_helpers import invariant as p
from k3.reference.lora import lora_delta_with

from .moe import ExpertWeight, run_experts


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
          indices: torch.Tensor) -> torch.Tensor:
    """`LoRADelta`: delta[t] = scales[i] B[i] (A[i] x[t]), i = indices[t] (0 where i < 0);
    [T, out] in the compute dtype."""
    return lora_delta_with(p.linear, x, a, b, scales, indices)


def experts(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, indices: torch.Tensor, *, w13_lora: list, w2_lora: list, scales: torch.Tensor,
            activation: str, beta: float | None = None, linear_beta: float | None = None,
            expert_start: int = 0) -> torch.Tensor:
    """`LoRAExperts`: the invariant experts with each row's adapter on w1 / w3 and w2."""
    return run_experts(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                       linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=False,
                       adapters=(delta, w13_lora, w2_lora, scales), slots=indices)
