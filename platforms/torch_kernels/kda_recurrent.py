"""KDA's token-serial recurrence in torch, vectorised over sequences and heads: what the
reference platform serves as `kda.recurrent` (decode with checkpoints, speculative verify).
`k3.plugin.kernels.KDARecurrent` is the contract; `k3.reference.kda_recurrent`, a plain loop
over each sequence's tokens, is its oracle. Without `cu_seqlens` there is no host
synchronisation (a decode batch runs as B = N, T = 1).
"""

from __future__ import annotations

import torch

from k3.ops_helpers import prepare_kda_inputs
from k3.plugin.kernels import KDARecurrentOut


def _step(S, q, k, v, g, beta):
    """One token for n (sequence, head) rows: S [n, HV, K, V]; q, k, g [n, HV, K]; v [n, HV, V].
    Returns (S, o, u): the new state, the output and the beta-scaled correction."""
    S = S * torch.exp(g)[..., None]  # decay along the key axis
    u = beta[..., None] * (v - torch.einsum("nhkv,nhk->nhv", S, k))  # [n, HV, V]
    S = S + k[..., None] * u[..., None, :]
    return S, torch.einsum("nhkv,nhk->nhv", S, q), u  # read after the update


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_per_position_states: bool = False,
    output_corrections: bool = False,
) -> KDARecurrentOut:
    """`KDARecurrent`: one step for every sequence (and head) at once per token index; with
    `cu_seqlens`, the sequences still running at that index, gathered by row (host reads)."""
    p = prepare_kda_inputs("kda_recurrent", q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, HV, K, V = p.shape
    S = p.state
    o = p.v.new_empty(B * T, HV, V)
    states = p.v.new_empty(B * T, HV, K, V) if output_per_position_states else None
    corrections = p.v.new_empty(B * T, HV, V) if output_corrections else None
    if cu_seqlens is None:  # every sequence has T tokens: rows b*T + t, a strided view
        views = [x.view(B, T, *x.shape[1:]) for x in (p.q, p.k, p.v, p.g, p.beta, o)]
        qv, kv, vv, gv, bv, ov = views
        sv = None if states is None else states.view(B, T, HV, K, V)
        uv = None if corrections is None else corrections.view(B, T, HV, V)
        for t in range(T):
            S, ov[:, t], u = _step(S, qv[:, t], kv[:, t], vv[:, t], gv[:, t], bv[:, t])
            if sv is not None:
                sv[:, t] = S
            if uv is not None:
                uv[:, t] = u
    else:
        lengths = [e - b for b, e in p.bounds]
        for t in range(max(lengths)):
            act = [n for n, length in enumerate(lengths) if length > t]
            seq = torch.tensor(act, device=S.device)
            rows = torch.tensor([p.bounds[n][0] + t for n in act], device=S.device)
            s, o[rows], u = _step(S[seq], p.q[rows], p.k[rows], p.v[rows], p.g[rows], p.beta[rows])
            S[seq] = s
            if states is not None:
                states[rows] = s
            if corrections is not None:
                corrections[rows] = u
    return KDARecurrentOut(o.view(B, T, HV, V).to(v.dtype), S,
                           states=None if states is None else states.view(B, T, HV, K, V),
                           corrections=None if corrections is None else corrections.view(B, T, HV, V))
