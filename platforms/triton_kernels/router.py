"""Expert selection in Triton: `MoEKernels.select_experts` (see k3.reference.select_experts).

One program per token does the whole selection in registers: scores (sigmoid, or softmax over
the experts), the correction bias added for selection only, top_k by repeated arg-max (ids in
descending selection score; an exact tie goes to the lower expert id), the unbiased weights of
the chosen ids, renormalisation and the routed scaling factor. One launch instead of the
reference's chain of sigmoid, add, topk, gather, sum and divide. DeepSeek's grouped top-k
(num_expert_group > 1), float64 and more than 4096 experts go to the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, s_l, s_w, s_i, E, scaling,
                   E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    present = experts < E
    x = tl.load(logits_ptr + t * s_l + experts, mask=present, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        shifted = tl.exp(x - tl.max(x, 0))
        scores = shifted / tl.sum(shifted, 0)
    scores = tl.where(present, scores, 0.0)
    select = scores
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + experts, mask=present, other=0.0).to(tl.float32)
    select = tl.where(present, select, float("-inf"))
    slots = tl.arange(0, K_PAD)
    chosen_w = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen_id = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(select, 0, tie_break_left=True)
        w = tl.sum(tl.where(experts == best, scores, 0.0), 0)
        chosen_w = tl.where(slots == j, w, chosen_w)
        chosen_id = tl.where(slots == j, best.to(tl.int64), chosen_id)
        select = tl.where(experts == best, float("-inf"), select)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, 0) + 1e-20)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * s_w + slots, chosen_w * scaling, mask=keep)
    tl.store(ids_ptr + t * s_i + slots, chosen_id, mask=keep)


def covers(logits, num_expert_group) -> bool:
    return (logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.dim() == 2
            and 1 <= logits.shape[1] <= 4096 and num_expert_group == 1 and logits.stride(-1) == 1)


def select_experts(logits, *, top_k, correction_bias=None, scoring="sigmoid", renormalize=True,
                   routed_scaling_factor=1.0, num_expert_group=1, topk_group=1, num_warps=None):
    """`k3.reference.select_experts` as one Triton kernel (same signature and contract).

    num_warps: a launch option for benchmarks (None: one warp up to 256 experts, where each of
    the top_k arg-max rounds is a warp's shuffles with no barrier; 4 up to 1024; 8 above)."""
    if not covers(logits, num_expert_group) or scoring not in ("sigmoid", "softmax") or not 1 <= top_k <= logits.shape[1]:
        return ref.select_experts(logits, top_k=top_k, correction_bias=correction_bias, scoring=scoring,
                                  renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
                                  num_expert_group=num_expert_group, topk_group=topk_group)
    t, e = logits.shape
    if correction_bias is not None and tuple(correction_bias.shape) != (e,):
        raise ValueError(f"select_experts: correction_bias must be [{e}], got {tuple(correction_bias.shape)}")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _select_kernel[(t,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids,
            logits.stride(0), weights.stride(0), ids.stride(0), e, float(routed_scaling_factor),
            E_PAD=triton.next_power_of_2(e), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
            num_warps=num_warps or (1 if e <= 256 else 4 if e <= 1024 else 8),
        )
    return weights, ids
