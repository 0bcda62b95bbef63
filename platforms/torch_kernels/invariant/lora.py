"""Batch-invariant LoRA (`LoRAKernels`, `k3.plugin.kernels.lora`): the reference's shrink and
expand per slot, each a ROW_BLOCK-row GEMM (`k3.ops_helpers.invariant.linear`), so a row's delta depends on
its own row and slot only; rows of other slots add exact zeros. The routed experts with adapters
are `invariant.moe.run_experts` with this delta."""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype

from k3.ops_helpers import invariant as p
from .moe import ExpertWeight, run_experts


def delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
          indices: torch.Tensor) -> torch.Tensor:
    """`LoRADelta`: delta[t] = scales[i] B[i] (A[i] x[t]), i = indices[t] (0 where i < 0);
    [T, out] in the compute dtype."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != x.shape[-1] or b.shape[2] != a.shape[1]:
        raise ValueError(f"lora_delta: a must be [S, R, {x.shape[-1]}] and b [S, out, R]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    if tuple(indices.shape) != (x.shape[0],) or tuple(scales.shape) != (a.shape[0],):
        raise ValueError(f"lora_delta: indices must be [{x.shape[0]}] and scales [{a.shape[0]}]; got "
                         f"{tuple(indices.shape)}, {tuple(scales.shape)}")
    cd = compute_dtype(x, a, b)
    xc, sc = x.to(cd), scales.to(cd)
    zero = torch.zeros((), dtype=cd, device=x.device)
    out = torch.zeros(x.shape[0], b.shape[1], dtype=cd, device=x.device)
    for s in range(a.shape[0]):
        weight = torch.where(indices == s, sc[s], zero)                                  # [T]
        out = out + p.linear(p.linear(xc, a[s].to(cd)) * weight[:, None], b[s].to(cd))
    return out


def experts(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, indices: torch.Tensor, *, w13_lora: list, w2_lora: list, scales: torch.Tensor,
            activation: str, beta: float | None = None, linear_beta: float | None = None,
            expert_start: int = 0) -> torch.Tensor:
    """`LoRAExperts`: the invariant experts with each row's adapter on w1 / w3 and w2."""
    return run_experts(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                       linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=False,
                       adapters=(delta, w13_lora, w2_lora, scales), slots=indices)
