"""Batch-invariant Block AttnRes (`AttnResKernels`, `k3.plugin.kernels.attn_res`): the
reference's formulas per token with ordered sums (the RMS, the logit dot product, the
softmax over sources and the weighted sum) and `pointwise` exp."""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.reference.attn_res import attn_res_with
from k3.plugin.kernels import AttnResOut

from k3.ops_helpers import invariant as p
from .elementwise import rms_norm


def mix(sources: torch.Tensor, query: torch.Tensor, *, eps: float) -> torch.Tensor:
    """`AttnResMix`: sources [S, T, D], query [D] -> [T, D] in sources' dtype."""
    if sources.dim() != 3 or query.shape != (sources.shape[-1],):
        raise ValueError(f"attn_res_mix: sources [S, T, D] and query [D] expected, got "
                         f"{tuple(sources.shape)} and {tuple(query.shape)}")
    cd = compute_dtype(sources)
    v = sources.to(cd)                                                           # [S, T, D]
    inv_rms = p.rsqrt(p.ordered_sum(v * v, -1) / v.shape[-1] + eps)              # [S, T]
    logits = p.ordered_dot(v, query.to(cd), -1) * inv_rms                        # [S, T]
    weights = p.softmax(logits, 0)
    return p.ordered_sum(weights[..., None] * v, 0).to(sources.dtype)


def step(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, *, query: torch.Tensor,
         num_visible_blocks: int, write_index: int | None, eps: float, out_norm_weight: torch.Tensor | None,
         out_eps: float) -> AttnResOut:
    """`AttnResStep`: the reference's four steps (add, write the block, mix, norm) with this
    module's mix and the invariant RMSNorm."""
    return attn_res_with(mix, rms_norm, prefix, delta, blocks, query=query, num_visible_blocks=num_visible_blocks,
                         write_index=write_index, eps=eps, out_norm_weight=out_norm_weight, out_eps=out_eps)
