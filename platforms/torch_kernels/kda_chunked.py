"""Chunked (WY/UT) KDA prefill in torch, one pass per sequence: what the reference platform
serves as `kda.chunked` (k3-model-math.md 3.6). `k3.plugin.kernels.KDAChunked` is the
contract; `k3.reference.kda_chunked`, the token-serial recurrence, is its oracle. Chunks start
at multiples of chunk_size from each sequence's start and are also cut at the checkpoint
offsets, so a segment may be shorter than chunk_size and any offset's state comes out of the
same pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.ops_helpers import checkpoint_offsets_per_sequence, chunk_cuts, prepare_kda_inputs
from k3.plugin.kernels import KDAChunkedOut


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
    """`KDAChunked` in the WY/UT form (the module docstring); chunk_size any positive int."""
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
