"""Batch-invariant router and routed experts (`MoEKernels`, `k3.plugin.kernels.moe`).

- router_logits: the fp32 product in ROW_BLOCK-row GEMMs (`k3.ops_helpers.invariant.linear`).
- select_experts: `pointwise` sigmoid (or an ordered softmax), the selection by a stable
  descending sort (equal scores: the lower expert id first, every call), the renormalising sum
  an `ordered_sum`.
- experts: each (token, choice) row runs its expert on its own row of ROW_BLOCK-row GEMMs
  (the expert's rows gathered, or every row masked with `dense_dispatch`: a row's product does
  not depend on its block, so both give the same bits), then each token sums its choices in
  choice order. `run_experts` takes per-expert LoRA adapters too (`invariant.lora`).
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.plugin.kernels import ExpertSelection
from k3.quant.mxfp4 import MXFP4Tensor

from k3.ops_helpers import invariant as p
from .elementwise import glu_activation

ExpertWeight = torch.Tensor | MXFP4Tensor


def router_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`RouterLogits`: h [T, D] @ weight [E, D]^T, both upcast (fp32; fp64 for float64)."""
    if h.dim() != 2 or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"router_logits: h must be [T, D] and weight [E, D]; got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}")
    cd = compute_dtype(h, weight)
    return p.linear(h.to(cd), weight.to(cd))


def _descending(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, largest first, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(logits: torch.Tensor, *, top_k: int, correction_bias: torch.Tensor | None = None,
                   scoring: str = "sigmoid", renormalize: bool = True, routed_scaling_factor: float = 1.0,
                   num_expert_group: int = 1, topk_group: int = 1) -> ExpertSelection:
    """`SelectExperts` (the module docstring)."""
    if logits.dim() != 2:
        raise ValueError(f"select_experts: logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e or num_expert_group < 1 or e % num_expert_group or not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"select_experts: top_k {top_k}, num_expert_group {num_expert_group} and topk_group "
                         f"{topk_group} do not fit E={e}")
    if correction_bias is not None and tuple(correction_bias.shape) != (e,):
        raise ValueError(f"select_experts: correction_bias must be [{e}], got {tuple(correction_bias.shape)}")
    lf = logits.to(compute_dtype(logits))
    if scoring == "sigmoid":
        scores = p.sigmoid(lf)
    elif scoring == "softmax":
        scores = p.softmax(lf, -1)
    else:
        raise ValueError(f"select_experts: scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    sel = scores if correction_bias is None else scores + correction_bias.to(lf.dtype)
    if num_expert_group > 1:      # DeepSeek's group rule: the groups of the best top-2 sums
        grouped = sel.reshape(t, num_expert_group, e // num_expert_group)
        best = grouped.gather(-1, _descending(grouped, min(2, grouped.shape[-1])))
        keep = _descending(p.ordered_sum(best, -1), topk_group)                                 # [T, topk_group]
        mask = torch.zeros(t, num_expert_group, dtype=torch.bool, device=sel.device).scatter_(1, keep, True)
        sel = sel.masked_fill(~mask.repeat_interleave(e // num_expert_group, 1), float("-inf"))
    ids = _descending(sel, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (p.ordered_sum(weights, -1, keepdim=True) + 1e-20)
    return ExpertSelection(weights * routed_scaling_factor, ids)


def _weight(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype, index=e) if isinstance(w, MXFP4Tensor) else w[e].to(dtype)


def _expert(rows, e, w13, w2, cd, act_kw, adapters, slots):
    """Local expert e on rows [n, L] (cd), with the rows' adapters (slots [n]): [n, L] cd."""
    delta, w13_lora, w2_lora, scales = adapters or (None, (), (), None)
    h13 = p.linear(rows, _weight(w13, e, cd))
    for cut, a, b in w13_lora:
        h13[:, cut] += delta(rows, a[:, e], b[:, e], scales, slots).to(cd)
    act = glu_activation(h13, **act_kw)
    out = p.linear(act, _weight(w2, e, cd))
    for cut, a, b in w2_lora:
        out[:, cut] += delta(act, a[:, e], b[:, e], scales, slots).to(cd)
    return out


def run_experts(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, activation: str, beta: float | None, linear_beta: float | None,
                expert_start: int, dense_dispatch: bool, adapters=None, slots: torch.Tensor | None = None):
    """The routed experts of this rank on x [T, L] (the module docstring). adapters: (delta,
    w13_lora, w2_lora, scales) as `lora_experts_forward` takes them, with slots [T]."""
    t, l = x.shape
    if len(w13.shape) != 3 or w13.shape[2] != l or tuple(w2.shape) != (w13.shape[0], l, w13.shape[1] // 2):
        raise ValueError(f"experts_forward: w13 must be [E_local, 2I, {l}] and w2 [E_local, {l}, I]; got "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_weights.shape[0] != t:
        raise ValueError(f"experts_forward: topk_weights and topk_ids must be [{t}, k]; got "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    cd = compute_dtype(x, *[w for w in (w13, w2) if isinstance(w, torch.Tensor)])
    act_kw = {"activation": activation, "beta": beta, "linear_beta": linear_beta}
    xf = x.to(cd)
    local = topk_ids.long() - expert_start                                                   # [T, k]
    chosen = xf.new_zeros(t, local.shape[1], l)                                               # each choice's output
    if dense_dispatch:          # every local expert on every row, no host synchronisation
        for e in range(w13.shape[0]):
            y = _expert(xf, e, w13, w2, cd, act_kw, adapters, slots)
            chosen = torch.where((local == e)[..., None], y[:, None], chosen)
    else:
        for e in local[(local >= 0) & (local < w13.shape[0])].unique().tolist():
            tok, choice = (local == e).nonzero(as_tuple=True)
            chosen[tok, choice] = _expert(xf[tok], e, w13, w2, cd, act_kw, adapters,
                                          None if slots is None else slots[tok])
    weights = topk_weights.to(cd)
    out = torch.zeros(t, l, dtype=cd, device=x.device)
    for j in range(local.shape[1]):                                                           # choice order
        out = out + weights[:, j, None] * chosen[:, j]
    return out.to(x.dtype)


def experts(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, *, activation: str, beta: float | None = None,
            linear_beta: float | None = None, expert_start: int = 0, dense_dispatch: bool = False) -> torch.Tensor:
    """`Experts` (the module docstring)."""
    return run_experts(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                       linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)
