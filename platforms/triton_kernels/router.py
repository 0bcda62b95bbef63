"""The router in Triton: `MoEKernels.router_logits` and `MoEKernels.select_experts` (see
k3.reference.router_logits and k3.reference.select_experts).

Router logits of small decode batches (up to LOGITS_MAX_TOKENS tokens): one program per (expert, block
of tokens) multiplies the token rows, widened to fp32, by the expert's fp32 gate row with fp32
FMAs and sums in fp32: one launch where the reference's upcast and cuBLAS's fp32 GEMV took three
(a copy of h to fp32, a dot kernel and its reduction) in each MoE layer. Larger batches go to the
reference (cuBLAS is faster there).

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
from k3.plugin.kernels import ExpertSelection


LOGITS_MAX_TOKENS = 4       # the H200 (bench/router.py): 7.4 vs 13.6 us at T = 1, 10.6 vs 20.5 at 4; 24.0 vs 22.3 at 16


@triton.jit
def _logits_kernel(h_ptr, w_ptr, out_ptr, s_h, s_w, s_o, T, D: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """out[t, e] = sum_d h[t, d] w[e, d] in fp32 for expert e = program_id(0) and BLOCK_T tokens."""
    e = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = tok < T
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask_d = cols < D
        w = tl.load(w_ptr + e * s_w + cols, mask=mask_d, other=0.0)                        # [BLOCK_D] fp32
        h = tl.load(h_ptr + tok[:, None].to(tl.int64) * s_h + cols[None, :], mask=mask_t[:, None] & mask_d[None, :],
                    other=0.0).to(tl.float32)                                           # [BLOCK_T, BLOCK_D]
        acc += h * w[None, :]
    tl.store(out_ptr + tok.to(tl.int64) * s_o + e, tl.sum(acc, 1), mask=mask_t)


def logits_cover(h, weight) -> bool:
    """The inputs `router_logits` computes in Triton; anything else goes to the reference op."""
    return (h.dim() == 2 and weight.dim() == 2 and h.shape[1] == weight.shape[1] and weight.dtype == torch.float32
            and h.dtype in (torch.float32, torch.bfloat16, torch.float16) and h.shape[0] <= LOGITS_MAX_TOKENS
            and h.stride(-1) == 1 and weight.stride(-1) == 1)


def router_logits(h, weight, *, block_t=None, block_d=None, num_warps=4):
    """`k3.reference.router_logits` (h [T, D] x weight [E, D] -> fp32 [T, E]) as one Triton launch
    for decode batches. block_t, block_d, num_warps: launch options for benchmarks (None: the
    tokens in blocks of up to 16, 4096 / block_t columns a step)."""
    if not logits_cover(h, weight):
        return ref.router_logits(h, weight)
    t, d = h.shape
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=h.device)
    if t:
        block_t = block_t or min(16, triton.next_power_of_2(t))
        block_d = block_d or min(triton.next_power_of_2(d), max(128, 4096 // block_t))
        _logits_kernel[(e, triton.cdiv(t, block_t))](h, weight, out, h.stride(0), weight.stride(0), out.stride(0), t,
                                                     D=d, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps)
    return out


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
    return ExpertSelection(weights, ids)
