"""Routed experts in torch: what the reference platform serves as `moe.experts`.
`k3.plugin.kernels.Experts` is the contract; `k3.reference.experts_forward`, token by token
over each token's experts, is its oracle. The default dispatch reads the used experts on the
host and runs each on its tokens; dense_dispatch runs every local expert on every token and
masks by the routing weights (no host synchronisation: decode, graph capture).
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype
from k3.quant.mxfp4 import MXFP4Tensor

ExpertWeight = torch.Tensor | MXFP4Tensor


def _check_2d(fn: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if t.dim() != 2 or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("?" if s is None else str(s) for s in shape)
        raise ValueError(f"{fn}: {name} must be [{want}], got {tuple(t.shape)}")


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
    """`Experts`, per expert: the module docstring."""
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
    xf = x.to(cd)
    wf = topk_weights.to(cd)
    local = topk_ids.long() - expert_start  # [T, k] local expert index
    out = torch.zeros(t, l, dtype=cd, device=x.device)
    if dense_dispatch:
        for e in range(e_local):
            gate = (wf * (local == e)).sum(-1, keepdim=True)  # [T, 1] routing weight of expert e
            h13 = xf @ _expert(w13, e, cd).T  # [T, 2I]
            a = ref.glu_activation(h13, activation=activation, beta=beta, linear_beta=linear_beta)
            out = out + (a @ _expert(w2, e, cd).T) * gate
        return out.to(x.dtype)
    used = local[(local >= 0) & (local < e_local)].unique()
    for e in used.tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)  # [n], [n]
        h13 = xf[tok] @ _expert(w13, e, cd).T  # [n, 2I]
        a = ref.glu_activation(h13, activation=activation, beta=beta, linear_beta=linear_beta)  # [n, I]
        o = a @ _expert(w2, e, cd).T  # [n, L]
        out.index_add_(0, tok, o * wf[tok, slot].unsqueeze(-1))
    return out.to(x.dtype)
