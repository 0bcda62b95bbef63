"""MoE kernel entries (router and routed experts): `MoEKernels`.

The router reads the full-width hidden state; the experts run in the latent width L of K3's
LatentMoE (the hidden width for plain MoE). Expert weights are stacked per layer, dense or
`k3.quant.mxfp4.MXFP4Tensor`: w13 `[E_local, 2I, L]` (rows 0..I-1 gate = checkpoint w1, rows
I..2I-1 up = w3), w2 `[E_local, L, I]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from k3.quant.mxfp4 import MXFP4Tensor


@dataclass(frozen=True)
class ExpertSelection:
    """weights `[T, k]` in the compute dtype (fp32; fp64 for float64 logits): the unbiased
    scores of the chosen experts, renormalised and scaled; ids int64 `[T, k]` global expert
    ids, by descending selection score."""

    weights: Tensor
    ids: Tensor


class RouterLogits(Protocol):
    """`moe.router_logits`: h `[T, D]` x weight `[E, D]` -> `[T, E]`, both operands upcast to fp32
    (fp64 if either is float64) before the matmul; the result stays in that dtype."""

    def __call__(self, h: Tensor, weight: Tensor) -> Tensor: ...


class SelectExperts(Protocol):
    """`moe.select_experts`: top_k experts per token from logits `[T, E]`.

    s = sigmoid(logits) (scoring "sigmoid", K3) or softmax over E ("softmax"); correction_bias
    `[E]` or None is added to s for the selection only; num_expert_group / topk_group: DeepSeek's
    grouped top-k (E % num_expert_group == 0; a group's score is the sum of its top-2 biased
    scores; experts outside the topk_group best groups are masked), 1 / 1 is plain top-k.
    weights = s[ids], divided by (their sum + 1e-20) when renormalize, then times
    routed_scaling_factor. Everything in the compute dtype. Returns `ExpertSelection`.
    """

    def __call__(self, logits: Tensor, *, top_k: int, correction_bias: Tensor | None = None,
                 scoring: str = "sigmoid", renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 num_expert_group: int = 1, topk_group: int = 1) -> ExpertSelection: ...


class Experts(Protocol):
    """`moe.experts`: out[t] = sum_i topk_weights[t, i] * W2_e act(W13_e x[t]), e = topk_ids[t, i].

    x `[T, L]`; w13, w2 as the module docstring (dense or MXFP4Tensor); topk_weights `[T, k]`;
    topk_ids int `[T, k]` global ids. This rank holds experts [expert_start, expert_start +
    E_local): other ids contribute nothing, so the ranks' outputs sum to the full result.
    activation "situ" (beta required, linear_beta optional) or "silu". Matmuls, activation and
    the weighted sum in the compute dtype, one cast at the end: returns `[T, L]` x.dtype, this
    rank's partial sum. A kernel for a 16-bit model may also round the gate/up products, the
    activation and each choice's down product to x.dtype (as the dense FFN does; grouped 16-bit
    GEMMs must), but then in every variant it picks (batch size, dispatch): a token's result may
    depend on its batch only through fp32 accumulation order (docs/batch-invariance.md). dense_dispatch=False may read the used experts on the host;
    dense_dispatch=True must not synchronise with the host (decode, graph capture); same result.
    """

    def __call__(self, x: Tensor, w13: Tensor | MXFP4Tensor, w2: Tensor | MXFP4Tensor, topk_weights: Tensor,
                 topk_ids: Tensor, *, activation: str, beta: float | None = None, linear_beta: float | None = None,
                 expert_start: int = 0, dense_dispatch: bool = False) -> Tensor: ...
