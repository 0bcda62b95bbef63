"""KDA's token-serial recurrence for XLA: `KDAKernels.recurrent` for packed sequences
without host reads.

`k3.plugin.kernels.KDARecurrent` is the contract, `k3.reference.kda_recurrent` its oracle.
Without `cu_seqlens` (decode: B = N, T = 1; speculative verify: B = N, T = 1 + k) this is the
reference platform's vectorised loop (`torch_kernels.kda_recurrent`), already free of host
reads. With `cu_seqlens` the packed tokens are scanned one at a time (`scan.scan`) with one
state: a token at position 0 of its sequence starts from that sequence's initial state, the
last token of a sequence writes its final state (segment flags by device arithmetic), and the
per-token outputs, states and corrections are the scan's outputs.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.platforms.torch_kernels import kda_recurrent as batched
from k3.plugin.kernels import KDARecurrentOut

from . import varlen
from .scan import scan


def _step(carry, x):
    """One packed token (module level and pure: torch-xla's scan traces it once per shape)."""
    S, finals, init_ = carry
    q_, k_, v_, g_, b_, first_, last_, n_ = x
    S = torch.where(first_, init_.index_select(0, n_[None])[0], S)          # [HV, K, V]
    S = S * torch.exp(g_)[..., None]
    u = b_[:, None] * (v_ - torch.einsum("hkv,hk->hv", S, k_))              # [HV, V]
    S = S + k_[..., None] * u[:, None, :]
    o = torch.einsum("hkv,hk->hv", S, q_)
    finals = finals.index_copy(0, n_[None], torch.where(last_, S, finals.index_select(0, n_[None])[0])[None])
    return (S, finals, init_), (o, S, u)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                  output_per_position_states=False, output_corrections=False) -> KDARecurrentOut:
    """`KDARecurrent` (the module docstring)."""
    if cu_seqlens is None:
        return batched.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                     output_per_position_states=output_per_position_states,
                                     output_corrections=output_corrections)
    op = "kda_recurrent"
    if q.dim() != 4 or k.shape != q.shape or q.shape[0] != 1:
        raise ValueError(f"{op}: with cu_seqlens q and k must be [1, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}")
    _, T, H, K = q.shape
    HV, V = v.shape[2:]
    if v.shape[:2] != (1, T) or HV % H or tuple(g.shape) != (1, T, HV, K) or tuple(beta.shape) != (1, T, HV):
        raise ValueError(f"{op}: v [1, T, HV, V], g [1, T, HV, K], beta [1, T, HV] expected; got {tuple(v.shape)}, "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}")
    N = cu_seqlens.shape[0] - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"{op}: initial_state must be [N, HV, K, V] = [{N}, {HV}, {K}, {V}]; "
                         f"got {tuple(initial_state.shape)}")
    dev, cd = q.device, compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    rep = HV // H
    qf = q[0].to(cd).repeat_interleave(rep, dim=1) * scale                      # [T, HV, K]
    kf = k[0].to(cd).repeat_interleave(rep, dim=1)
    vf, gf, bf = v[0].to(cd), g[0].to(cd), beta[0].to(cd)
    init = torch.zeros(N, HV, K, V, dtype=cd, device=dev) if initial_state is None else initial_state.to(cd)
    seq, pos = varlen.token_sequences(cu_seqlens, T)
    live = seq < N
    n = seq.clamp(max=N - 1)
    first = live & (pos == 0)
    last = live & (pos == varlen.lengths(cu_seqlens).gather(0, n) - 1)

    carry = (init.new_zeros(HV, K, V), init.clone(), init)
    (_, finals, _), (o, states, u) = scan(_step, carry, (qf, kf, vf, gf, bf, first, last, n))
    return KDARecurrentOut(o[None].to(v.dtype), finals,
                           states=states[None] if output_per_position_states else None,
                           corrections=u[None] if output_corrections else None)
