"""Chunked KDA prefill in torch, every chunk's intra-chunk work at once: `KDAKernels.chunked`
(see k3.reference.kda_chunked for the contract).

The reference walks one chunk at a time and builds, per chunk, the decay between every pair of
positions on every key channel ([H, C, C, K]: 200 MB a chunk at K3's 96 heads x 128, so 156 ms
a layer for 8K tokens on an H200). This computes the same function in two phases:

1. All chunks of all sequences at once (in groups that bound the memory): the decay-weighted
   products k_i e^(G_i - G_j) k_j and q_i e^(G_i - G_j) k_j as 16-token blocks. A block below
   the diagonal is one matmul of both sides scaled to the end r of the j block, e^(G_i - G_r) and
   e^(G_r - G_j), each at most 1 (G, the cumulative log decay, never increases), so nothing can
   overflow whatever the gate; the diagonal blocks keep the exact pairwise decays ([16, 16, K]
   per block). Then the unit lower-triangular solve of the WY/UT form, as the reference.
2. The state recurrence, chunk after chunk, batched over the sequences (one round per chunk
   index): the only sequential part, a few batched matmuls per chunk.

Chunks start every chunk_size tokens from each sequence's start and are also cut at the
checkpoint offsets, exactly as the reference cuts them; a shorter chunk is padded with tokens
that change nothing (k = v = 0, no decay, beta = 0). fp32 throughout (fp64 for float64 inputs),
exact matmuls; fp32 / fp64 states and checkpoints.
"""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.reference.conv import checkpoint_offsets_per_sequence
from k3.reference.kda import chunk_cuts, prepare_kda_inputs

BLOCK = 16                    # the diagonal blocks' size: exact pairwise decays inside
GROUP_ELEMENTS = 1 << 27      # floats of the diagonal decays built at once (512 MiB in fp32)


def _segments(bounds, wanted, chunk):
    """(sequence, start, end) of every chunk in packed-token coordinates (the reference's cuts,
    `chunk_cuts`), ordered by sequence, and for each sequence the list of its chunks' indices."""
    segments, per_sequence = [], []
    for n, (bos, eos) in enumerate(bounds):
        cuts = chunk_cuts(eos - bos, chunk, wanted[n] if wanted else ())
        per_sequence.append(list(range(len(segments), len(segments) + len(cuts) - 1)))
        segments += [(n, bos + a, bos + z) for a, z in zip(cuts[:-1], cuts[1:])]
    return segments, per_sequence


def _intra_chunk(q, k, v, g, beta):
    """Phase 1 for a group of padded chunks: q (scaled), k, g [S, HV, C, K]; v [S, HV, C, V];
    beta [S, HV, C]. Returns (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)) of the WY/UT form."""
    S, HV, C, K = q.shape
    G = g.cumsum(2)                                                       # [S, HV, C, K]
    A_kk = q.new_zeros(S, HV, C, C)
    A_qk = q.new_zeros(S, HV, C, C)
    lower = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).tril()
    for b0 in range(0, C, BLOCK):
        jb = slice(b0, min(b0 + BLOCK, C))
        width = jb.stop - jb.start
        Gj = G[:, :, jb]                                                  # [S, HV, w, K]
        # the diagonal block: exact pairwise decays, j <= i
        diff = Gj[:, :, :, None, :] - Gj[:, :, None, :, :]                # [S, HV, i, j, K]
        decay = torch.exp(diff.masked_fill(~lower[:width, :width, None], float("-inf")))
        kj = k[:, :, jb]
        A_kk[:, :, jb, jb] = torch.einsum("shic,shijc,shjc->shij", kj, decay, kj)
        A_qk[:, :, jb, jb] = torch.einsum("shic,shijc,shjc->shij", q[:, :, jb], decay, kj)
        if jb.stop < C:                 # the rows below: both sides scaled to the block's end r
            Gr = Gj[:, :, -1:]                                            # [S, HV, 1, K]
            right = kj * torch.exp(Gr - Gj)                               # [S, HV, w, K], factors <= 1
            rows = slice(jb.stop, C)
            left = torch.exp(G[:, :, rows] - Gr)                          # [S, HV, C - end, K], <= 1
            A_kk[:, :, rows, jb] = (k[:, :, rows] * left) @ right.transpose(-1, -2)
            A_qk[:, :, rows, jb] = (q[:, :, rows] * left) @ right.transpose(-1, -2)
    b = beta[..., None]                                                   # [S, HV, C, 1]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    IL = eye + (b * A_kk).tril(-1)                                        # I + L, unit lower triangular
    eG = torch.exp(G)
    WU = torch.linalg.solve_triangular(IL, b * torch.cat([eG * k, v], dim=-1), upper=False, unitriangular=True)
    W, U = WU.split([K, v.shape[-1]], dim=-1)
    GC = G[:, :, -1:]                                                     # [S, HV, 1, K]
    return W, U, A_qk.tril(), q * eG, torch.exp(GC - G) * k, torch.exp(GC)


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None):
    """`k3.reference.kda_chunked` (same signature and contract), all chunks' intra-chunk work
    batched; chunk_size must be a multiple of 16 here (the reference takes the others)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < BLOCK or chunk_size % BLOCK:
        return ref.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets)
    op = "kda_chunked"
    p = prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens)   # the contract's errors
    B, T, HV, K, V = p.shape
    bounds, N, dev = p.bounds, len(p.bounds), q.device
    wanted = (None if checkpoint_offsets is None
              else checkpoint_offsets_per_sequence(checkpoint_offsets, [e - s for s, e in bounds], op))
    # rows [B*T + 1, HV, *] in the compute dtype, a zero row last (what padding tokens read)
    qf, kf, vf, gf, bf = (torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (p.q, p.k, p.v, p.g, p.beta))
    segments, per_sequence = _segments(bounds, wanted, chunk_size)
    C = chunk_size
    pad = B * T                                                           # the zero row
    index = torch.full((len(segments), C), pad, dtype=torch.long)
    for s, (_, a, z) in enumerate(segments):
        index[s, : z - a] = torch.arange(a, z)
    index = index.to(dev)

    # phase 1, in groups whose diagonal decays fit GROUP_ELEMENTS
    per_chunk = HV * C * BLOCK * K
    group = max(1, GROUP_ELEMENTS // per_chunk)
    parts = []
    for s0 in range(0, len(segments), group):
        sel = index[s0: s0 + group]
        qs, ks, vs, gs = (x[sel].permute(0, 2, 1, 3) for x in (qf, kf, vf, gf))
        parts.append(_intra_chunk(qs, ks, vs, gs, bf[sel].transpose(1, 2)))
    W, U, A_qk, qeG, kdec, eGC = (torch.cat(chunked) for chunked in zip(*parts))

    # phase 2: the recurrence, one round per chunk index, the sequences batched
    state = p.state
    o_chunks = torch.empty(len(segments), HV, C, V, dtype=state.dtype, device=dev)
    at = [{0: state[n]} for n in range(N)]                                # state after `offset` tokens
    for r in range(max(len(c) for c in per_sequence)):
        seqs = [n for n in range(N) if len(per_sequence[n]) > r]
        segs = torch.tensor([per_sequence[n][r] for n in seqs], device=dev)
        rows = torch.tensor(seqs, device=dev)
        S0 = state[rows]                                                  # [n, HV, K, V]
        delta = U[segs] - W[segs] @ S0                                    # [n, HV, C, V]
        o_chunks[segs] = qeG[segs] @ S0 + A_qk[segs] @ delta
        S1 = eGC[segs].transpose(-1, -2) * S0 + kdec[segs].transpose(-1, -2) @ delta
        state = state.index_copy(0, rows, S1)
        if wanted:
            for j, n in enumerate(seqs):
                _, a, z = segments[per_sequence[n][r]]
                at[n][z - bounds[n][0]] = S1[j]
    o = vf.new_empty(B * T + 1, HV, V)
    o[index.reshape(-1)] = o_chunks.permute(0, 2, 1, 3).reshape(-1, HV, V)   # padding lands on the last row
    out = (o[:-1].view(B, T, HV, V).to(v.dtype), state)
    if wanted is None:
        return out
    count = len(wanted[0]) if wanted else 0
    return (*out, [torch.stack([at[n][wanted[n][c]] for n in range(N)]) for c in range(count)])
