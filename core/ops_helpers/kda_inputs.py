"""The KDA entries' input checks and the inputs in the compute dtype, the start of the naive
reference and of every torch KDA kernel (`k3.plugin.kernels.kda` states the layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.dtypes import compute_dtype, upcast

from .varlen import sequence_bounds


@dataclass
class KDAInputs:
    """Validated inputs in the compute dtype, flattened to rows of [B*T] and per value head."""

    q: torch.Tensor  # [B*T, HV, K], scaled
    k: torch.Tensor  # [B*T, HV, K]
    v: torch.Tensor  # [B*T, HV, V]
    g: torch.Tensor  # [B*T, HV, K]
    beta: torch.Tensor  # [B*T, HV]
    state: torch.Tensor  # [N, HV, K, V], a fresh tensor
    bounds: list[tuple[int, int]]  # (bos, eos) rows of each sequence
    shape: tuple[int, int, int, int, int]  # B, T, HV, K, V


def prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, *, zero_row=False) -> KDAInputs:
    """The contract's checks of the KDA ops' inputs (raising its errors, named for `op`), then
    the inputs in the compute dtype as `KDAInputs` (q scaled, heads repeated to the value heads,
    the initial state copied or zeros). Kernels that take the same inputs start from it.

    zero_row: q, k, v, g and beta get one more row, all zeros, after the B*T rows (what a kernel
    gathering padded chunks reads for their padding), written in the same pass as the rest:
    no second copy to append it."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a float tensor; got {t.dtype}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be [B, T, H, K]; got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(
            f"{op}: k must be [B, T, H, K] = {list(q.shape)} like q; got {tuple(k.shape)}"
        )
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % H != 0:
        raise ValueError(
            f"{op}: v must be [B, T, HV, V] with B={B}, T={T} and HV a multiple of H={H}; "
            f"got {tuple(v.shape)}"
        )
    HV, V = v.shape[2:]
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(
            f"{op}: g must be [B, T, HV, K] = [{B}, {T}, {HV}, {K}]; got {tuple(g.shape)}"
        )
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(
            f"{op}: beta must be [B, T, HV] = [{B}, {T}, {HV}]; got {tuple(beta.shape)}"
        )
    bounds = sequence_bounds(cu_seqlens, B, T, op)
    N = len(bounds)
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(
            f"{op}: initial_state must be [N, HV, K, V] = [{N}, {HV}, {K}, {V}]; "
            f"got {tuple(initial_state.shape)}"
        )
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale

    rows = B * T + (1 if zero_row else 0)

    def flat(x: torch.Tensor, heads_of: int, width: int, factor=None) -> torch.Tensor:
        """x [B, T, heads_of, width] in cd as [rows, HV, width], heads repeated to HV (each
        head's rep copies adjacent), times factor; one pass into a fresh buffer when there is
        anything to do (a cast, a repeat, a factor or the zero row), else x's own view."""
        if not zero_row and factor is None and heads_of == HV and x.dtype == cd:
            return x.reshape(B * T, HV, width)
        out = torch.empty(rows, HV, width, dtype=cd, device=x.device)
        if zero_row:
            out[-1].zero_()
        body = out[: B * T].view(B * T, heads_of, HV // heads_of, width)
        src = x.reshape(B * T, heads_of, 1, width).expand(B * T, heads_of, HV // heads_of, width)
        body.copy_(src)                                                 # the cast, in the same pass
        if factor is not None:
            body.mul_(factor)                                           # in cd, as the reference scales
        return out

    state = (
        torch.zeros(N, HV, K, V, dtype=cd, device=q.device)
        if initial_state is None
        else upcast(initial_state, cd).clone()
    )
    return KDAInputs(
        q=flat(q, H, K, scale),
        k=flat(k, H, K),
        v=flat(v, HV, V),
        g=flat(g, HV, K),
        beta=flat(beta[..., None], HV, 1)[..., 0],
        state=state,
        bounds=bounds,
        shape=(B, T, HV, K, V),
    )
