"""Batch-invariant KDA (`KDAKernels`, `k3.plugin.kernels.kda`): every entry runs the recurrence
token by token in decode's order, so a token's output and state are the same whether it was
decoded alone, decoded among others, or reached inside a prefill chunk of any size.

Per token of a sequence (rows of the sequences still running at that index are stepped
together; every operation is elementwise or an `ordered_sum` over K, so the rows never mix):

    S = S * exp(g)[:, None];   u = beta * (v - ordered_sum_K(S * k));   S = S + k u^T
    o = ordered_sum_K(S * q)          (q scaled by K^-0.5 first, as `prepare_kda_inputs` does)

`chunked` is this recurrence (no chunking at all; `chunk_size` is ignored) with its checkpoint
states, `recurrent` the same with per-position states and corrections, `decode_step` the
layer's unfused decode composed from this module's and `elementwise`'s entries, `gate` and
`short_conv` the reference formulas with `pointwise` transcendental functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import checkpoint_offsets_per_sequence, prepare_kda_inputs
from k3.plugin.kernels import KDAChunkedOut, KDARecurrentOut, ShortConvOut

from ..short_conv import short_conv as torch_short_conv
from k3.ops_helpers import invariant as p
from .elementwise import gated_rms_norm, l2_norm


def gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None, *,
         lower_bound: float | None = None) -> torch.Tensor:
    """`KDAGate`: lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (K3) or
    -exp(A_log) softplus(f + dt_bias) (Kimi-Linear), in the compute dtype."""
    hv, kd = f.shape[-2:]
    if tuple(A_log.shape) not in ((hv,), (1, 1, hv, 1)):
        raise ValueError(f"kda_gate: A_log must be [HV] = [{hv}] (or legacy [1, 1, {hv}, 1]); got {tuple(A_log.shape)}")
    cd = compute_dtype(f, A_log, dt_bias)
    x = upcast(f, cd)
    if dt_bias is not None:
        x = x + upcast(dt_bias, cd).reshape(hv, kd)
    a = p.exp(upcast(A_log, cd).reshape(hv, 1))
    if lower_bound is not None:
        return lower_bound * p.sigmoid(a * x)
    return -a * p.softplus(x)


def short_conv(x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu",
               checkpoint_offsets: Sequence[int] | torch.Tensor | None = None) -> ShortConvOut:
    """`ShortConv`: each window's taps summed in tap order (elementwise), `pointwise` SiLU."""
    return torch_short_conv(x, weight, conv_state=conv_state, cu_seqlens=cu_seqlens, activation=activation,
                            checkpoint_offsets=checkpoint_offsets, silu=p.silu)


def _step(S, q, k, v, g, beta):
    """One token for n rows: S [n, HV, K, V]; q, k, g [n, HV, K]; v [n, HV, V]; beta [n, HV].
    Returns (S, o, u)."""
    S = S * p.exp(g)[..., None]
    u = beta[..., None] * (v - p.ordered_dot(S, k[..., None], -2))                 # [n, HV, V]
    S = S + k[..., None] * u[..., None, :]
    return S, p.ordered_dot(S, q[..., None], -2), u


def _serial(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, *, offsets=None, per_position=False,
            corrections=False):
    """The recurrence over every sequence, token index by token index. offsets: per sequence
    the token counts after which to keep the state. Returns (o [B, T, HV, V] v.dtype, final
    state, {(n, offset): state}, states [B*T, ...] or None, corrections [B*T, ...] or None)."""
    x = prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, HV, K, V = x.shape
    S = x.state
    lengths = [e - b for b, e in x.bounds]
    o = x.v.new_empty(B * T, HV, V)
    states = x.v.new_empty(B * T, HV, K, V) if per_position else None
    us = x.v.new_empty(B * T, HV, V) if corrections else None
    want = [set() if offsets is None else set(offsets[n]) for n in range(len(lengths))]
    kept = {(n, 0): S[n].clone() for n in range(len(lengths)) if 0 in want[n]}
    for t in range(max(lengths, default=0)):
        seqs = [n for n, length in enumerate(lengths) if length > t]
        every = len(seqs) == len(lengths)
        rows = torch.tensor([x.bounds[n][0] + t for n in seqs], device=S.device)
        index = None if every else torch.tensor(seqs, device=S.device)
        s, o[rows], u = _step(S if every else S[index], x.q[rows], x.k[rows], x.v[rows], x.g[rows], x.beta[rows])
        if every:
            S = s
        else:
            S[index] = s
        if states is not None:
            states[rows] = s
        if us is not None:
            us[rows] = u
        for j, n in enumerate(seqs):
            if t + 1 in want[n]:
                kept[(n, t + 1)] = s[j].clone()
    return o.view(B, T, HV, V).to(v.dtype), S, kept, states, us


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: float | None = None, initial_state: torch.Tensor | None = None,
            cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
            checkpoint_offsets: Sequence[int] | torch.Tensor | None = None) -> KDAChunkedOut:
    """`KDAChunked` in decode's order (the module docstring): `chunk_size` is not used."""
    lengths = None
    offsets = None
    if checkpoint_offsets is not None:
        B, T = q.shape[:2]
        if cu_seqlens is None:
            lengths = [T] * B
        else:
            cu = cu_seqlens.tolist()
            lengths = [b - a for a, b in zip(cu, cu[1:])]
        offsets = checkpoint_offsets_per_sequence(checkpoint_offsets, lengths, "kda_chunked")
    o, state, kept, _, _ = _serial("kda_chunked", q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets=offsets)
    checkpoints = () if offsets is None else tuple(
        torch.stack([kept[(n, offsets[n][c])] for n in range(len(offsets))]) for c in range(len(offsets[0])))
    return KDAChunkedOut(o, state, checkpoints)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              cu_seqlens: torch.Tensor | None = None, output_per_position_states: bool = False,
              output_corrections: bool = False) -> KDARecurrentOut:
    """`KDARecurrent`: the same recurrence as `chunked`."""
    o, state, _, states, us = _serial("kda_recurrent", q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                      per_position=output_per_position_states, corrections=output_corrections)
    B, T, HV, V = o.shape
    return KDARecurrentOut(o, state, states=None if states is None else states.view(B, T, HV, *states.shape[2:]),
                           corrections=None if us is None else us.view(B, T, HV, V))


def rebuild_state(initial_state: torch.Tensor, k: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                  num_kept: torch.Tensor) -> torch.Tensor:
    """`KDARebuildState`: the state update replayed token by token over the kept tokens (dropped
    positions are selected away, never multiplied: they may hold NaN)."""
    if k.dim() != 4 or g.shape != k.shape or u.shape[:3] != k.shape[:3] or initial_state.dim() != 4:
        raise ValueError(f"kda_rebuild_state: k, g [N, L, HV, K], u [N, L, HV, V] and initial_state "
                         f"[N, HV, K, V] expected, got {tuple(k.shape)}, {tuple(g.shape)}, {tuple(u.shape)}, "
                         f"{tuple(initial_state.shape)}")
    cd = compute_dtype(initial_state, k, g, u)
    S = upcast(initial_state, cd).clone()
    kept = num_kept.to(k.device).long()
    for t in range(k.shape[1]):
        live = (t < kept)[:, None, None, None]
        kt, gt, ut = (torch.where(live[..., 0], upcast(z[:, t], cd), 0.0) for z in (k, g, u))
        S = torch.where(live, S * p.exp(gt)[..., None] + kt[..., None] * ut[..., None, :], S)
    return S


def decode_step(qkv: torch.Tensor, conv_weight: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                dt_bias: torch.Tensor, b: torch.Tensor, out_gate: torch.Tensor, o_norm_weight: torch.Tensor,
                recurrent: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor,
                fresh: torch.Tensor, *, lower_bound: float | None, norm_eps: float, l2_eps: float = 1e-6,
                scale: float | None = None) -> torch.Tensor:
    """`KDADecodeStep`: short_conv, l2_norm, gate, sigmoid(b), one recurrence step and
    gated_rms_norm of this package, the state and conv rows updated in place."""
    n, h, kd = f.shape
    rows = state_indices.long()
    conv_in = conv_state[rows].masked_fill(fresh[:, None, None], 0)                  # [N, 3HK, W-1]
    s0 = recurrent[rows].masked_fill(fresh[:, None, None, None], 0)               # [N, H, K, V]
    conv = short_conv(qkv.unsqueeze(1), conv_weight, conv_state=conv_in)               # y [N, 1, 3HK]
    conv_state[rows] = conv.state
    yq, yk, v = conv.y.reshape(n, 3, h, kd).unbind(1)
    q, kk = l2_norm(yq, l2_eps), l2_norm(yk, l2_eps)
    g = gate(f, A_log, dt_bias, lower_bound=lower_bound)
    beta = p.sigmoid(b.to(g.dtype))
    o, state, _, _, _ = _serial("kda_decode_step", q[:, None], kk[:, None], v[:, None], g[:, None], beta[:, None],
                                scale, s0, None)
    recurrent[rows] = state.to(recurrent.dtype)
    return gated_rms_norm(o[:, 0], out_gate, o_norm_weight, norm_eps)
