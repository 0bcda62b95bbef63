"""Routed experts and K3's Stable LatentMoE block (reference).

    z     = W_down h                     [T, L]   (L = latent width; h itself when no down-proj)
    u     = sum_i w_i * W2_i act(W13_i z) [T, L]   (routed experts, combined in latent space)
    y_lat = RMSNorm_w(u)                          (only with latent_norm_weight)
    y     = W_up y_lat + Shared(h)       [T, D]   (shared GLU MLP on the ORIGINAL h)

The router (`router_logits`, `select_experts`, re-exported here) reads the full-width h.
For tensor / expert parallelism the block splits into pieces whose partial results add:
`latent_moe_routed_partial` (router + down + this rank's experts -> latent partial u) and
`glu_mlp` on a shard of the shared expert (-> partial shared output); sum each across ranks,
then `latent_moe_finish(u, shared_out=...)` (norm + up + shared add). `latent_moe` is the
single-process composition of the three.

Rounding points mirror the bf16 model: every matmul runs in fp32 (fp64 for float64) and its
result is cast to the activation dtype (z, u, y_lat, the up-proj and shared outputs); the
expert intermediate and the weighted combine stay in the compute dtype.
"""

from __future__ import annotations

import torch

from ..dtypes import compute_dtype
from .activations import glu_activation
from .norms import rms_norm
from .router import router_logits, select_experts
from ..quant.mxfp4 import MXFP4Tensor

__all__ = [
    "router_logits", "select_experts", "glu_mlp", "experts_forward",
    "latent_moe_routed_partial", "latent_moe_finish", "latent_moe",
]  # fmt: skip

ExpertWeight = torch.Tensor | MXFP4Tensor


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T in fp32 (fp64 if either is float64), cast to x.dtype."""
    cd = compute_dtype(x, weight)
    return (x.to(cd) @ weight.to(cd).T).to(x.dtype)


def _check_2d(fn: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if t.dim() != 2 or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(f"{fn}: {name} must be [{want}], got {tuple(t.shape)}")


def glu_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    activation: str,
    beta: float | None = None,
    linear_beta: float | None = None,
) -> torch.Tensor:
    """Dense GLU MLP: down(act([gate | up] = x gate_up^T)) (shared experts, dense layer 0).

    x [T, D]; gate_up [2I, D] (first I rows gate = `gate_proj`, next I up = `up_proj`);
    down [D, I]. Matmuls and activation in fp32 (fp64 for float64); the gate_up output,
    activation and down output are each cast to x.dtype (the model's rounding points).
    Under TP, a shard of I (rows of gate and of up, columns of down) gives a partial sum.
    Returns [T, D] of x.dtype.
    """
    _check_2d("glu_mlp", "x", x, (None, None))
    _check_2d("glu_mlp", "gate_up", gate_up, (None, x.shape[1]))
    if gate_up.shape[0] % 2:
        raise ValueError(f"glu_mlp: gate_up must be [2I, {x.shape[1]}], got {tuple(gate_up.shape)}")
    _check_2d("glu_mlp", "down", down, (x.shape[1], gate_up.shape[0] // 2))
    a = glu_activation(_linear(x, gate_up), activation=activation, beta=beta, linear_beta=linear_beta)
    return _linear(a, down)


def _expert(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense weight of local expert e in `dtype` (an MXFP4Tensor dequantises only that expert)."""
    return w.dequantize(dtype, index=e) if isinstance(w, MXFP4Tensor) else w[e].to(dtype)


def experts_forward(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str,
    beta: float | None = None,
    linear_beta: float | None = None,
    expert_start: int = 0,
    dense_dispatch: bool = False,
) -> torch.Tensor:
    """Oracle of `Experts`: token by token over its chosen experts, each dequantised once
    (dense_dispatch changes nothing here: both dispatches of a kernel must give this)."""
    fn = "experts_forward"
    _check_2d(fn, "x", x, (None, None))
    t, l = x.shape
    if len(w13.shape) != 3 or w13.shape[2] != l or w13.shape[1] % 2:
        raise ValueError(f"{fn}: w13 must be [E_local, 2I, {l}], got {tuple(w13.shape)}")
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e_local, l, inter):
        raise ValueError(f"{fn}: w2 must be [{e_local}, {l}, {inter}], got {tuple(w2.shape)}")
    _check_2d(fn, "topk_weights", topk_weights, (t, None))
    if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_ids.is_floating_point():
        raise ValueError(f"{fn}: topk_ids must be an int tensor [{t}, k] like topk_weights, got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    dense = [w for w in (w13, w2) if isinstance(w, torch.Tensor)]
    cd = compute_dtype(x, *dense)
    experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}        # local expert -> dense (w13, w2)
    out = torch.zeros(t, l, dtype=cd, device=x.device)
    for i in range(t):
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[i, slot]) - expert_start                  # local index; others belong elsewhere
            if not 0 <= e < e_local:
                continue
            if e not in experts:
                experts[e] = (_expert(w13, e, cd), _expert(w2, e, cd))
            gate_up, down = experts[e]                                 # [2I, L], [L, I]
            a = glu_activation(gate_up @ x[i].to(cd), activation=activation, beta=beta, linear_beta=linear_beta)
            out[i] += topk_weights[i, slot].to(cd) * (down @ a)
    return out.to(x.dtype)


def latent_moe_routed_partial(
    h: torch.Tensor,
    *,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    w13: ExpertWeight,
    w2: ExpertWeight,
    top_k: int,
    scoring: str,
    renormalize: bool,
    routed_scaling_factor: float,
    num_expert_group: int,
    topk_group: int,
    activation: str,
    beta: float | None,
    linear_beta: float | None,
    down_weight: torch.Tensor | None = None,
    expert_start: int = 0,
) -> torch.Tensor:
    """Router + latent down-projection + this rank's experts: the latent partial u [T, L].

    h [T, D]; gate_weight [E, D] (all experts); correction_bias [E] fp32 or None;
    down_weight [L, D] or None (plain MoE: L = D, z = h). w13 / w2 / expert_start as in
    `experts_forward`. Router in fp32 (fp64 for float64 h). Returns u [T, L] of h.dtype:
    sum it over EP/TP ranks, then call `latent_moe_finish`.
    """
    fn = "latent_moe_routed_partial"
    _check_2d(fn, "h", h, (None, None))
    _check_2d(fn, "gate_weight", gate_weight, (None, h.shape[1]))
    if down_weight is not None:
        _check_2d(fn, "down_weight", down_weight, (None, h.shape[1]))
    chosen = select_experts(
        router_logits(h, gate_weight),
        top_k=top_k,
        correction_bias=correction_bias,
        scoring=scoring,
        renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
    )
    z = h if down_weight is None else _linear(h, down_weight)  # [T, L]
    return experts_forward(
        z, w13, w2, chosen.weights, chosen.ids,
        activation=activation, beta=beta, linear_beta=linear_beta, expert_start=expert_start,
    )  # fmt: skip


def latent_moe_finish(
    u: torch.Tensor,
    *,
    up_weight: torch.Tensor | None = None,
    latent_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    shared_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Finish the block from the fully reduced latent sum u [T, L].

    y = up(rms_norm(u)) + shared_out: rms_norm only with latent_norm_weight [L] (K3's
    `routed_expert_norm`, eps norm_eps, fp32 normalise then x.dtype, then x weight);
    up_weight [D, L] or None (plain MoE: y has width L); shared_out [T, D] (the reduced shared
    expert output) or None. Up-proj in fp32, cast to u.dtype; the add is in u.dtype.
    Returns [T, D] of u.dtype.
    """
    fn = "latent_moe_finish"
    _check_2d(fn, "u", u, (None, None))
    t, l = u.shape
    if latent_norm_weight is not None and tuple(latent_norm_weight.shape) != (l,):
        raise ValueError(f"{fn}: latent_norm_weight must be [{l}], got {tuple(latent_norm_weight.shape)}")
    y = u if latent_norm_weight is None else rms_norm(u, latent_norm_weight, norm_eps)
    if up_weight is not None:
        _check_2d(fn, "up_weight", up_weight, (None, l))
        y = _linear(y, up_weight)  # [T, D]
    if shared_out is not None:
        _check_2d(fn, "shared_out", shared_out, (t, y.shape[1]))
        y = y + shared_out.to(y.dtype)
    return y


def latent_moe(
    h: torch.Tensor,
    *,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    w13: ExpertWeight,
    w2: ExpertWeight,
    top_k: int,
    scoring: str,
    renormalize: bool,
    routed_scaling_factor: float,
    num_expert_group: int,
    topk_group: int,
    activation: str,
    beta: float | None,
    linear_beta: float | None,
    down_weight: torch.Tensor | None = None,
    up_weight: torch.Tensor | None = None,
    latent_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-5,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    expert_start: int = 0,
) -> torch.Tensor:
    """K3's Stable LatentMoE block (or Kimi-Linear's plain MoE when down/up are None).

    h [T, D] -> [T, D] of h.dtype. Router on h (gate_weight [E, D], correction_bias [E]);
    z = down(h) with down_weight [L, D]; routed experts in L (w13 [E_local, 2I, L],
    w2 [E_local, L, I], dense or MXFP4Tensor); u = weighted sum; y = up(rms_norm(u)) with
    latent_norm_weight [L] (optional) and up_weight [D, L]; plus the shared GLU MLP on the
    ORIGINAL h (shared_gate_up [2*Is, D], shared_down [D, Is]; both or neither).
    Single-process composition of `latent_moe_routed_partial`, `glu_mlp` and
    `latent_moe_finish` (see the module docstring for the parallel split). expert_start is
    passed to the experts; the result is the whole block only when this process holds every
    routed expert (the norm is not linear: EP/TP ranks reduce u before `latent_moe_finish`).
    """
    if (down_weight is None) != (up_weight is None):
        raise ValueError("latent_moe: down_weight [L, D] and up_weight [D, L] must be given together")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError(
            "latent_moe: shared_gate_up [2*Is, D] and shared_down [D, Is] must be given together"
        )
    u = latent_moe_routed_partial(
        h,
        gate_weight=gate_weight, correction_bias=correction_bias, w13=w13, w2=w2, top_k=top_k,
        scoring=scoring, renormalize=renormalize, routed_scaling_factor=routed_scaling_factor,
        num_expert_group=num_expert_group, topk_group=topk_group, activation=activation,
        beta=beta, linear_beta=linear_beta, down_weight=down_weight, expert_start=expert_start,
    )  # fmt: skip
    shared_out = None
    if shared_gate_up is not None:
        shared_out = glu_mlp(
            h, shared_gate_up, shared_down, activation=activation, beta=beta, linear_beta=linear_beta
        )
    return latent_moe_finish(
        u,
        up_weight=up_weight,
        latent_norm_weight=latent_norm_weight,
        norm_eps=norm_eps,
        shared_out=shared_out,
    )
