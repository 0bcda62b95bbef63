"""MoE router: fp32 logits and biased top-k selection (DeepSeek-V3 / Kimi K2 / K3 style).

    s       = sigmoid(logits)            (or softmax over experts)    weights come from s
    s_sel   = s + correction_bias        used ONLY to choose experts
    ids     = top-k(s_sel)  [after the DeepSeek group mask when num_expert_group > 1]
    w       = s[ids] / (sum s[ids] + 1e-20) if renormalize, then * routed_scaling_factor

K3: sigmoid, 896 experts, top-16, one group, renormalize, scaling 1.0.
"""

from __future__ import annotations

import torch

from k3.plugin.kernels import ExpertSelection

from ..dtypes import compute_dtype


def router_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Oracle of `RouterLogits`: both operands upcast, one matmul (as vLLM's
    `GateLinear(out_dtype=float32)`)."""
    if h.dim() != 2:
        raise ValueError(f"router_logits: h must be [T, D], got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"router_logits: weight must be [E, {h.shape[1]}], got {tuple(weight.shape)}")
    cd = compute_dtype(h, weight)
    return h.to(cd) @ weight.to(cd).T  # [T, E]


def _group_mask(sel: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek group rule: bool [T, E], True for experts in the topk_group best groups.

    Group score = sum of the top-2 biased scores inside the group (top-1 for 1-expert groups).
    """
    t, e = sel.shape
    grouped = sel.reshape(t, num_expert_group, e // num_expert_group)  # [T, G, E/G]
    group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
    keep = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
    gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
    return gmask.unsqueeze(-1).expand_as(grouped).reshape(t, e)


def select_experts(
    logits: torch.Tensor,
    *,
    top_k: int,
    correction_bias: torch.Tensor | None = None,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    num_expert_group: int = 1,
    topk_group: int = 1,
) -> ExpertSelection:
    """Oracle of `SelectExperts`: scores, bias for the selection, DeepSeek's group mask, top-k,
    the unbiased weights renormalised and scaled (the module docstring)."""
    if logits.dim() != 2:
        raise ValueError(f"select_experts: logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"select_experts: top_k must be in [1, {e}], got {top_k}")
    if correction_bias is not None and tuple(correction_bias.shape) != (e,):
        raise ValueError(f"select_experts: correction_bias must be [{e}], got {tuple(correction_bias.shape)}")
    if num_expert_group < 1 or e % num_expert_group:
        raise ValueError(f"select_experts: num_expert_group must divide E={e}, got {num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"select_experts: topk_group must be in [1, {num_expert_group}], got {topk_group}")
    if top_k > topk_group * (e // num_expert_group):
        raise ValueError(
            f"select_experts: top_k={top_k} exceeds topk_group={topk_group} groups"
            f" x {e // num_expert_group} experts"
        )
    cd = compute_dtype(logits)
    lf = logits.to(cd)
    if scoring == "sigmoid":
        scores = torch.sigmoid(lf)  # [T, E]
    elif scoring == "softmax":
        scores = torch.softmax(lf, dim=-1)
    else:
        raise ValueError(f"select_experts: scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    sel = scores if correction_bias is None else scores + correction_bias.to(cd)
    if num_expert_group > 1:
        sel = sel.masked_fill(~_group_mask(sel, num_expert_group, topk_group), float("-inf"))
    ids = sel.topk(top_k, dim=-1, sorted=True).indices  # [T, k], descending selection score
    weights = scores.gather(1, ids)  # [T, k] unbiased
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ExpertSelection(weights * routed_scaling_factor, ids)
