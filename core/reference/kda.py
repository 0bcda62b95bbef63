"""Kimi Delta Attention, the oracle: the recurrence one token at a time, one sequence at a time.

The contract (layout, shapes, dtypes) is `k3.plugin.kernels.kda`. Per token, for every value
head, with the K-major state S [K, V] (k3-model-math.md 3.4):

    S = S * exp(g)[:, None];   u = beta * (v - S^T k);   S = S + k u^T;   o = scale * S^T q

`kda_chunked` is the same loop (a chunked kernel must equal it up to rounding; chunk_size only
tiles a kernel's work), `kda_rebuild_state` replays the state update over the kept tokens.
Nothing here is written for speed: the reference platform serves the torch kernels of
`k3.platforms.torch_kernels`, which conformance checks against these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import KDAInputs, checkpoint_offsets_per_sequence, prepare_kda_inputs
from k3.plugin.kernels import KDAChunkedOut, KDARecurrentOut

from .kda_gate import kda_gate

__all__ = ["kda_gate", "kda_recurrent", "kda_chunked", "kda_rebuild_state"]


def _token(S, q, k, v, g, beta):
    """One token of every value head: S [HV, K, V]; q (scaled), k, g [HV, K]; v [HV, V]; beta [HV].
    Returns (S, o [HV, V], u [HV, V]): the new state, the output and the correction."""
    S = S * torch.exp(g)[..., None]                                    # decay along the key axis
    u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))         # beta-scaled correction
    S = S + k[..., None] * u[:, None, :]                               # rank-one update k u^T
    return S, torch.einsum("hkv,hk->hv", S, q), u                      # read after the update


def _recurrence(p: KDAInputs, *, offsets=None, keep_states=False, keep_corrections=False):
    """The recurrence over every sequence of `p`, token by token.

    offsets: per sequence, the token counts after which the state is also kept (checkpoints).
    Returns (o [B*T, HV, V], final states [N, HV, K, V], states [B*T, HV, K, V] or None,
    corrections [B*T, HV, V] or None, checkpoints: one [N, HV, K, V] per offset column).
    """
    B, T, HV, K, V = p.shape
    o = p.v.new_zeros(B * T, HV, V)
    states = p.v.new_zeros(B * T, HV, K, V) if keep_states else None
    corrections = p.v.new_zeros(B * T, HV, V) if keep_corrections else None
    finals, kept = [], []
    for n, (bos, eos) in enumerate(p.bounds):
        wanted = [] if offsets is None else offsets[n]
        S = p.state[n]                                                 # [HV, K, V]
        after = {0: S} if 0 in wanted else {}                          # token count -> state
        for i, t in enumerate(range(bos, eos)):
            S, o[t], u = _token(S, p.q[t], p.k[t], p.v[t], p.g[t], p.beta[t])
            if states is not None:
                states[t] = S
            if corrections is not None:
                corrections[t] = u
            if i + 1 in wanted:
                after[i + 1] = S
        finals.append(S)
        kept.append([after[c] for c in wanted])
    columns = len(offsets[0]) if offsets else 0
    checkpoints = tuple(torch.stack([row[c] for row in kept]) for c in range(columns))
    return o, torch.stack(finals), states, corrections, checkpoints


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
    """Oracle of `KDARecurrent`: the module docstring's loop."""
    p = prepare_kda_inputs("kda_recurrent", q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, HV, K, V = p.shape
    o, final, states, corrections, _ = _recurrence(p, keep_states=output_per_position_states,
                                                   keep_corrections=output_corrections)
    return KDARecurrentOut(o.view(B, T, HV, V).to(v.dtype), final,
                           states=None if states is None else states.view(B, T, HV, K, V),
                           corrections=None if corrections is None else corrections.view(B, T, HV, V))


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    checkpoint_offsets: Sequence[int] | torch.Tensor | None = None,
) -> KDAChunkedOut:
    """Oracle of `KDAChunked`: the same loop, keeping the states at the checkpoint offsets
    (chunk_size is checked and otherwise unused: the oracle has no chunks)."""
    op = "kda_chunked"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int; got {chunk_size!r}")
    p = prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, HV, K, V = p.shape
    offsets = (None if checkpoint_offsets is None
               else checkpoint_offsets_per_sequence(checkpoint_offsets, [e - b for b, e in p.bounds], op))
    o, final, _, _, checkpoints = _recurrence(p, offsets=offsets)
    return KDAChunkedOut(o.view(B, T, HV, V).to(v.dtype), final, checkpoints)


def kda_rebuild_state(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    num_kept: torch.Tensor,
) -> torch.Tensor:
    """Oracle of `KDARebuildState`: the state update S = S * exp(g_t)[:, None] + k_t u_t^T replayed
    over each sequence's first num_kept[n] records (the rest never read)."""
    op = "kda_rebuild_state"
    if k.dim() != 4 or g.shape != k.shape or u.shape[:3] != k.shape[:3] or initial_state.dim() != 4:
        raise ValueError(f"{op}: k, g [N, L, HV, K], u [N, L, HV, V] and initial_state "
                         f"[N, HV, K, V] expected, got {tuple(k.shape)}, {tuple(g.shape)}, {tuple(u.shape)}, "
                         f"{tuple(initial_state.shape)}")
    length = k.shape[1]
    kept = [int(n) for n in num_kept.tolist()]
    if any(not 0 <= n <= length for n in kept):
        raise ValueError(f"{op}: num_kept must lie in [0, L={length}]; got {kept}")
    cd = compute_dtype(initial_state, k, g, u)
    out = upcast(initial_state, cd).clone()
    for n, count in enumerate(kept):
        S = out[n]                                                     # [HV, K, V]
        for t in range(count):
            kt, gt, ut = upcast(k[n, t], cd), upcast(g[n, t], cd), upcast(u[n, t], cd)   # [HV, K], [HV, K], [HV, V]
            S = S * torch.exp(gt)[..., None] + kt[..., None] * ut[:, None, :]
        out[n] = S
    return out
