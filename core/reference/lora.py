"""LoRA reference ops: the per-row adapter delta of a linear layer and the routed experts with
per-expert adapters (the multi-adapter "punica" contract, written the plain way).

Adapters live in slots: stacked A [S, R, in] and B [S, out, R] with a scale per slot; an adapter
of rank r < R is zero-padded (its extra rows / columns add nothing). Each token row names its
slot (`indices` [T] int64), -1 for none; a row without an adapter gets exactly zero delta. The
products run in fp32 (fp64 for float64 inputs, `k3.dtypes.compute_dtype`); the delta is
returned in that dtype so the caller adds it once before its own rounding point.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype

from .activations import glu_activation
from .moe import ExpertWeight, _expert

__all__ = ["lora_delta", "lora_experts_forward"]


def _check(fn: str, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
           indices: torch.Tensor, lead: int) -> None:
    s = a.shape[0]
    if a.dim() != 3 + lead or a.shape[-1] != x.shape[-1]:
        raise ValueError(f"{fn}: a must be [S, {'E, ' * lead}R, {x.shape[-1]}], got {tuple(a.shape)}")
    if b.dim() != 3 + lead or b.shape[0] != s or b.shape[-1] != a.shape[-2] or b.shape[1:1 + lead] != a.shape[1:1 + lead]:
        raise ValueError(f"{fn}: b must be [{s}, {'E, ' * lead}out, {a.shape[-2]}], got {tuple(b.shape)}")
    if tuple(scales.shape) != (s,):
        raise ValueError(f"{fn}: scales must be [{s}], got {tuple(scales.shape)}")
    if tuple(indices.shape) != (x.shape[0],) or indices.is_floating_point():
        raise ValueError(f"{fn}: indices must be an int tensor [{x.shape[0]}], got {indices.dtype} "
                         f"{tuple(indices.shape)}")


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
               indices: torch.Tensor) -> torch.Tensor:
    """delta[t] = scales[i] * B[i] @ (A[i] @ x[t]) with i = indices[t]; zero where i < 0.

    x [T, in]; a [S, R, in]; b [S, out, R]; scales [S]; indices [T] int (-1: no adapter).
    Returns [T, out] in the compute dtype of x and the adapters (no host synchronisation)."""
    return lora_delta_with(lambda u, w: u @ w.T, x, a, b, scales, indices)


def lora_delta_with(linear, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                    indices: torch.Tensor) -> torch.Tensor:
    """`lora_delta` with `linear(u, w)` = u @ w^T given (the batch-invariant kernels pass theirs)."""
    _check("lora_delta", x, a, b, scales, indices, 0)
    cd = compute_dtype(x, a, b)
    xc, sc = x.to(cd), scales.to(cd)
    zero = torch.zeros((), dtype=cd, device=x.device)
    out = torch.zeros(x.shape[0], b.shape[1], dtype=cd, device=x.device)
    # one shrink and one expand per slot over every row, each row weighted by its slot's scale or 0:
    # no gather of per-row adapter copies ([T, R, in] would not fit at real sizes), no host sync
    for s in range(a.shape[0]):
        weight = torch.where(indices == s, sc[s], zero)                          # [T]
        out += linear(linear(xc, a[s].to(cd)) * weight[:, None], b[s].to(cd))
    return out


def lora_experts_forward(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    indices: torch.Tensor,
    *,
    w13_lora: list[tuple[slice, torch.Tensor, torch.Tensor]],
    w2_lora: list[tuple[slice, torch.Tensor, torch.Tensor]],
    scales: torch.Tensor,
    activation: str,
    beta: float | None = None,
    linear_beta: float | None = None,
    expert_start: int = 0,
) -> torch.Tensor:
    """`experts_forward` with per-expert adapters on w13 (gate / up rows) and w2 (down).

    x [T, L]; w13 [E_local, 2I, L] and w2 [E_local, L, I], dense or MXFP4 (dequantised per
    expert, the adapters stay in their own dtype); topk as `experts_forward`; indices [T] the
    token's adapter slot (-1 none). w13_lora / w2_lora: (rows of the weight's output the
    adapter writes, A [S, E_local, R, in], B [S, E_local, rows, R]); scales [S].
    Each chosen expert computes act((W13 + s B13 A13) x) then (W2 + s B2 A2) a, weighted and
    summed over the token's experts; returns [T, L] of x.dtype."""
    t, l = x.shape
    e_local = w13.shape[0]
    cd = compute_dtype(x, *[w for w in (w13, w2) if isinstance(w, torch.Tensor)])
    out = torch.zeros(t, l, dtype=cd, device=x.device)
    xc = x.to(cd)
    for e in range(e_local):
        tok, slot_k = (topk_ids - expert_start == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        rows, idx = xc[tok], indices[tok]
        gate_up = rows @ _expert(w13, e, cd).T                                          # [n, 2I]
        for cut, a, b in w13_lora:
            gate_up[:, cut] += lora_delta(rows, a[:, e], b[:, e], scales, idx).to(cd)
        act = glu_activation(gate_up, activation=activation, beta=beta, linear_beta=linear_beta)
        down = act @ _expert(w2, e, cd).T                                               # [n, L]
        for cut, a, b in w2_lora:
            down[:, cut] += lora_delta(act, a[:, e], b[:, e], scales, idx).to(cd)
        out.index_add_(0, tok, topk_weights[tok, slot_k].to(cd)[:, None] * down)
    return out.to(x.dtype)
