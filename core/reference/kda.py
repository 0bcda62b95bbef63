"""Kimi Delta Attention reference: token-serial recurrence and the chunked WY/UT form.

Layout (fla-core's): q, k [B, T, H, K] (already L2-normalised; `scale` is applied here),
v [B, T, HV, V], g [B, T, HV, K] log decay (<= 0, e.g. from `kda_gate`), beta [B, T, HV]
(after the sigmoid), states [N, HV, K, V] (K-major). HV is a multiple of H: value head j
reads q/k head j // (HV // H). With `cu_seqlens` [N+1] B = 1 and N sequences are packed
along T; without it N = B. Per token, with the K-major state S [K, V]:
    S = S * exp(g)[:, None];  u = beta * (v - S^T k);  S = S + k u^T;  o = scale * S^T q
(k3-model-math.md 3.4; the output is read after the update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.plugin.kernels import KDAChunkedOut, KDARecurrentOut

from ..dtypes import compute_dtype, upcast
from .conv import checkpoint_offsets_per_sequence, sequence_bounds
from .kda_gate import kda_gate

__all__ = ["kda_gate", "kda_recurrent", "kda_chunked", "kda_rebuild_state"]


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
    """Token-serial KDA (the oracle), vectorised over sequences and heads.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV] (any float
    dtypes); scale: default K ** -0.5; initial_state: [N, HV, K, V] or None (zeros);
    cu_seqlens: integer [N+1] (B = 1) or None (N = B; then no host synchronisation).
    Computed in fp32 (fp64 if any input is float64). Returns (o [B, T, HV, V] in v.dtype,
    final_state [N, HV, K, V] in the compute dtype); with output_per_position_states also
    states [B, T, HV, K, V] (compute dtype), the state after each token; with
    output_corrections also u [B, T, HV, V] (compute dtype), each token's beta-scaled
    delta-rule correction, from which `kda_rebuild_state` rebuilds any prefix's state
    (RecoverSSM-style speculative rollback). Extra outputs come in this order.
    """
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


def kda_rebuild_state(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    num_kept: torch.Tensor,
) -> torch.Tensor:
    """The state after the first num_kept[n] of L recorded tokens, rebuilt in closed form:

        S_n = diag(e^{G_n}) S_0 + sum_{t < n} diag(e^{G_n - G_t}) k_t u_t^T,  G_t = g_1 + ... + g_t

    initial_state [N, HV, K, V] (the state before the tokens); k [N, L, HV, K] the L2-normalised
    keys (expanded to the value heads); g [N, L, HV, K] log decays; u [N, L, HV, V] the
    corrections `kda_recurrent(..., output_corrections=True)` returns; num_kept [N] int in
    [0, L]; positions at or past num_kept[n] are never read (they may be NaN or stale).
    Exact because every kept correction was computed along the same trajectory
    (speculative decoding: rebuild the state at the accepted length, RecoverSSM). No host
    synchronisation. Returns [N, HV, K, V] in the compute dtype (fp32, fp64 for float64).
    """
    if k.dim() != 4 or g.shape != k.shape or u.shape[:3] != k.shape[:3] or initial_state.dim() != 4:
        raise ValueError(f"kda_rebuild_state: k, g [N, L, HV, K], u [N, L, HV, V] and initial_state "
                         f"[N, HV, K, V] expected, got {tuple(k.shape)}, {tuple(g.shape)}, {tuple(u.shape)}, "
                         f"{tuple(initial_state.shape)}")
    cd = compute_dtype(initial_state, k, g, u)
    s0, kk, gg, uu = (upcast(x, cd) for x in (initial_state, k, g, u))
    n, length = k.shape[:2]
    G = gg.cumsum(1)                                                     # [N, L, HV, K] inclusive
    kept = num_kept.to(k.device).long()
    last = (kept - 1).clamp(min=0)
    Gn = G.gather(1, last[:, None, None, None].expand(n, 1, *G.shape[2:]))[:, 0]     # [N, HV, K]
    Gn = torch.where((kept > 0)[:, None, None], Gn, torch.zeros_like(Gn))
    live = (torch.arange(length, device=k.device)[None, :] < kept[:, None])[:, :, None, None]   # [N, L, 1, 1]
    # dropped positions may hold anything (unwritten records are NaN): select, never multiply by 0
    decay = torch.where(live, torch.exp(torch.where(live, Gn[:, None] - G, 0.0)), 0.0)        # [N, L, HV, K]
    kk, uu = torch.where(live, kk, 0.0), torch.where(live, uu, 0.0)
    return torch.exp(Gn)[..., None] * s0 + torch.einsum("nlhk,nlhv->nhkv", decay * kk, uu)


def _chunk(S0, q, k, v, g, beta):
    """One chunk of the WY/UT form (k3-model-math.md 3.6) for all heads at once.

    S0 [HV, K, V]; q (scaled), k, g [C, HV, K]; v [C, HV, V]; beta [C, HV].
    Returns (o [C, HV, V], S [HV, K, V]). Only non-positive log decays are exponentiated.
    """
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [HV, C, *]
    b = beta.transpose(0, 1)[..., None]  # [HV, C, 1]
    C, K = q.shape[1], q.shape[2]
    G = g.cumsum(1)  # [HV, C, K] cumulative log decay, non-increasing along C
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    diff = G[:, :, None, :] - G[:, None, :, :]  # [HV, C_i, C_j, K]: G_i - G_j
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))  # 0 for j > i
    kk = torch.einsum("hic,hijc,hjc->hij", k, decay, k)  # [HV, C, C]
    qk = torch.einsum("hic,hijc,hjc->hij", q, decay, k)  # [HV, C, C], lower incl. diagonal
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    IL = eye + (b * kk).tril(-1)  # I + L, unit lower triangular
    eG = torch.exp(G)  # [HV, C, K]
    rhs = b * torch.cat([eG * k, v], dim=-1)  # diag(beta) [e^G * K | V]: [HV, C, K+V]
    WU = torch.linalg.solve_triangular(IL, rhs, upper=False, unitriangular=True)
    Wm, U = WU.split([K, v.shape[-1]], dim=-1)  # [HV, C, K], [HV, C, V]
    delta = U - Wm @ S0  # [HV, C, V]: the u_t of the recurrence
    o = (q * eG) @ S0 + qk @ delta  # [HV, C, V]
    GC = G[:, -1:, :]  # [HV, 1, K]
    S = torch.exp(GC).transpose(1, 2) * S0 + (torch.exp(GC - G) * k).transpose(1, 2) @ delta
    return o.transpose(0, 1), S


def chunk_cuts(length: int, chunk_size: int, offsets: Sequence[int] = ()) -> list[int]:
    """The chunk boundaries of a sequence of `length` tokens: every chunk_size tokens from its
    start, and at each checkpoint offset (0 and length included, sorted, once each)."""
    return sorted({0, length, *range(0, length, chunk_size), *offsets})


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
    """Chunked (WY/UT) KDA, equal to `kda_recurrent` up to rounding; one pass per sequence.

    Arguments as `kda_recurrent`; chunk_size: any positive int. checkpoint_offsets: ints [C]
    shared by every sequence, or an integer tensor [N, C]; each offset in [0, len_n]. Chunks
    start at multiples of chunk_size from each sequence's start and are also split at the
    offsets, so a segment may be shorter than chunk_size.
    Computed in fp32 (fp64 if any input is float64). Returns (o [B, T, HV, V] in v.dtype,
    final_state [N, HV, K, V] in the compute dtype), plus, with checkpoint_offsets, a list of
    C tensors [N, HV, K, V] (compute dtype): the state after that many tokens of each
    sequence (offset 0 = initial state), in the given order.
    """
    op = "kda_chunked"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int; got {chunk_size!r}")
    p = prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, HV, K, V = p.shape
    lengths = [e - b for b, e in p.bounds]
    offsets = (
        None
        if checkpoint_offsets is None
        else checkpoint_offsets_per_sequence(checkpoint_offsets, lengths, op)
    )
    o = p.v.new_empty(B * T, HV, V)
    finals, per_seq_ckpts = [], []
    for n, (bos, eos) in enumerate(p.bounds):
        wanted = [] if offsets is None else offsets[n]
        cuts = chunk_cuts(eos - bos, chunk_size, wanted)
        S = p.state[n]  # [HV, K, V]
        at = {0: S}  # state after `offset` tokens
        for a, z in zip(cuts[:-1], cuts[1:]):
            rows = slice(bos + a, bos + z)
            o[rows], S = _chunk(S, p.q[rows], p.k[rows], p.v[rows], p.g[rows], p.beta[rows])
            at[z] = S
        finals.append(S)
        per_seq_ckpts.append([at[off] for off in wanted])
    n_ckpt = len(offsets[0]) if offsets else 0
    checkpoints = tuple(torch.stack([c[i] for c in per_seq_ckpts]) for i in range(n_ckpt))
    return KDAChunkedOut(o.view(B, T, HV, V).to(v.dtype), torch.stack(finals), checkpoints)
