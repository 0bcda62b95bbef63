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
2. The state recurrence, chunk after chunk: the only sequential part. `recurrence_torch` batches
   it over the sequences (one round per chunk index, a few batched matmuls each); `kda_chunked`
   takes another with the same contract (`recurrence=`), such as the one-launch Triton kernel
   `triton_kernels/kda_chunked_recurrence.py`.

Chunks start every chunk_size tokens from each sequence's start and are also cut at the
checkpoint offsets, exactly as the reference cuts them; a shorter chunk is padded with tokens
that change nothing (k = v = 0, no decay, beta = 0). fp32 throughout (fp64 for float64 inputs),
exact matmuls; fp32 / fp64 states and checkpoints.

The diagonal blocks are a function `kda_chunked` takes (`diagonal=`): by default the torch
einsums here (`diagonal_blocks_torch`, which build each block's [16, 16, K] decays), or one
that builds nothing, such as the Triton kernel `triton_kernels/kda_intra_diagonal.py` (whose
wrapper, `triton_kernels/kda_chunked_blocked.py`, passes it; this module imports no Triton).
"""

from __future__ import annotations

import functools

import torch

from k3.ops_helpers import checkpoint_offsets_per_sequence, chunk_cuts, prepare_kda_inputs
from k3.plugin.kernels import KDAChunkedOut

from . import kda_chunked as wy

BLOCK = 16                    # the diagonal blocks' size: exact pairwise decays inside
GROUP_ELEMENTS = 1 << 27      # floats of the diagonal decays built at once (512 MiB in fp32)


def working_floats(hv, c, k, v):
    """Floats phase 1 holds per chunk at its peak besides the diagonal's own work: the gathered
    q, k, v, g, G and e^G, A_kk, A_qk and I + L, the solve's right side and result and the
    outputs (counted from `_intra_chunk`'s live tensors: about 10 [C, K], 3 [C, V] and 4 [C, C]
    per head). What bounds the groups when the diagonal materialises nothing."""
    return hv * c * (10 * k + 3 * v + 4 * c)


def _segments(bounds, wanted, chunk):
    """(sequence, start, end) of every chunk in packed-token coordinates (the reference's cuts,
    `chunk_cuts`) in round-major order, and the sequences in the order phase 2 walks them.

    Sequences are ordered by chunk count, most first (`order`); round r holds the r-th chunk of
    each sequence with more than r chunks, which are then the first `sizes[r]` of `order`, and
    its segments are contiguous (`sizes[:r].sum()` onwards): each round slices its chunks and its
    states instead of gathering them. Returns (segments, order, sizes)."""
    cuts = [chunk_cuts(eos - bos, chunk, wanted[n] if wanted else ()) for n, (bos, eos) in enumerate(bounds)]
    order = sorted(range(len(bounds)), key=lambda n: -len(cuts[n]))
    segments, sizes = [], []
    for r in range(len(cuts[order[0]]) - 1):
        active = [n for n in order if len(cuts[n]) - 1 > r]
        sizes.append(len(active))
        segments += [(n, bounds[n][0] + cuts[n][r], bounds[n][0] + cuts[n][r + 1]) for n in active]
    return segments, order, sizes


def diagonal_blocks_torch(q, k, G, A_kk, A_qk, block=BLOCK):
    """The diagonal blocks of the decay-weighted products, written into A_kk and A_qk
    [S, HV, C, C] (nothing else of them is touched): for each block of `block` rows starting
    at b0 and i >= j inside it,
        A_kk[.., b0+i, b0+j] = sum_c k_i,c e^(G_i,c - G_j,c) k_j,c
        A_qk[.., b0+i, b0+j] = sum_c q_i,c e^(G_i,c - G_j,c) k_j,c
    and 0 for j > i; q, k, G (the cumulative log decays) [S, HV, C, K]. Builds each block's
    exact pairwise decays ([S, HV, block, block, K]), masked before the exponential."""
    C = q.shape[2]
    lower = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    for b0 in range(0, C, block):
        jb = slice(b0, min(b0 + block, C))
        width = jb.stop - jb.start
        Gj = G[:, :, jb]                                                  # [S, HV, w, K]
        diff = Gj[:, :, :, None, :] - Gj[:, :, None, :, :]                # [S, HV, i, j, K]
        decay = torch.exp(diff.masked_fill(~lower[:width, :width, None], float("-inf")))
        kj = k[:, :, jb]
        A_kk[:, :, jb, jb] = torch.einsum("shic,shijc,shjc->shij", kj, decay, kj)
        A_qk[:, :, jb, jb] = torch.einsum("shic,shijc,shjc->shij", q[:, :, jb], decay, kj)


def _intra_chunk(q, k, v, g, beta, diagonal=diagonal_blocks_torch):
    """Phase 1 for a group of padded chunks: q (scaled), k, g [S, HV, C, K]; v [S, HV, C, V];
    beta [S, HV, C]; `diagonal` writes the diagonal blocks (`diagonal_blocks_torch`'s
    contract). Returns (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)) of the WY/UT form."""
    S, HV, C, K = q.shape
    G = g.cumsum(2)                                                       # [S, HV, C, K]
    A_kk = q.new_zeros(S, HV, C, C)
    A_qk = q.new_zeros(S, HV, C, C)
    diagonal(q, k, G, A_kk, A_qk, block=BLOCK)                            # the blocks on the diagonal
    for b0 in range(0, C, BLOCK):
        jb = slice(b0, min(b0 + BLOCK, C))
        Gj = G[:, :, jb]                                                  # [S, HV, w, K]
        kj = k[:, :, jb]
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


def intra_chunk_torch(q, k, v, g, beta, index, diagonal=None, group_elements=None):
    """Phase 1 for all chunks: q (scaled), k, g [rows, HV, K], v [rows, HV, V], beta [rows, HV],
    the packed tokens in the compute dtype with a zero row (what a padded chunk position reads);
    index [nseg, C], the row of each chunk position. Returns `_intra_chunk`'s (W, U, A_qk, q e^G,
    k e^(G_C - G), e^(G_C)) for the nseg chunks, [nseg, HV, C, *].

    Computed in groups of chunks whose diagonal decays (the torch diagonal) or working tensors
    (another `diagonal`, taken to materialise nothing: `working_floats` per chunk) hold at most
    group_elements (default GROUP_ELEMENTS) floats."""
    nseg, C = index.shape
    HV, K, V = q.shape[1], q.shape[2], v.shape[2]
    if diagonal is None or diagonal is diagonal_blocks_torch:
        diagonal, per_chunk = diagonal_blocks_torch, HV * C * BLOCK * K
    else:
        per_chunk = working_floats(HV, C, K, V)
    group = max(1, (group_elements or GROUP_ELEMENTS) // per_chunk)
    parts = []
    for s0 in range(0, nseg, group):
        sel = index[s0: s0 + group]
        qs, ks, vs, gs = (x[sel].permute(0, 2, 1, 3) for x in (q, k, v, g))
        parts.append(_intra_chunk(qs, ks, vs, gs, beta[sel].transpose(1, 2), diagonal))
    return tuple(torch.cat(chunked) for chunked in zip(*parts))


def recurrence_torch(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture=()):
    """Phase 2, the state recurrence across chunks: for each sequence's chunks in order, from its
    initial state S,

        delta = U_c - W_c @ S                     [C, V]
        o_c   = qeG_c @ S + A_qk_c @ delta        [C, V]
        S     = eGC_c^T * S + kdec_c^T @ delta    [K, V]

    The chunks (segments) are in round-major order (`_segments`): round r holds the r-th chunk of
    each of the first sizes[r] sequences of `order`, in that order, as segments
    sizes[:r].sum() onwards. W, qeG, kdec [nseg, HV, C, K]; U [nseg, HV, C, V]; A_qk
    [nseg, HV, C, C] (lower triangular); eGC [nseg, HV, 1, K]; initial [N, HV, K, V] in the
    sequences' own order (0 .. N-1); capture: segment indices whose end state is wanted (each
    once). All in the compute dtype (fp32, or fp64).

    Returns (o_chunks [nseg, HV, C, V], final states [N, HV, K, V] in the sequences' order,
    captured [len(capture), HV, K, V] in capture's order), all in initial's dtype. This one: one
    round of batched matmuls per chunk index, the sequences batched (a few launches a round).
    """
    dev = initial.device
    nseg, HV, C, V = U.shape
    K = W.shape[-1]
    where = torch.tensor(order, device=dev)
    # the states are held in `order` (most chunks first), so round r's are the first sizes[r]
    # rows and its chunks the next sizes[r] segments: slices and in-place products, no gathers
    state = initial[where]                                                # [N, HV, K, V], a copy
    o_chunks = torch.empty(nseg, HV, C, V, dtype=state.dtype, device=dev)
    captured = torch.empty(len(capture), HV, K, V, dtype=state.dtype, device=dev)
    slot = {s: i for i, s in enumerate(capture)}
    flat = lambda x: x.flatten(0, 1)                                      # noqa: E731  [n, HV, a, b] -> [n*HV, a, b]
    s0 = 0
    for size in sizes:
        segs = slice(s0, s0 + size)
        S0 = state[:size]                                                 # [n, HV, K, V] (a view)
        delta = torch.baddbmm(flat(U[segs]), flat(W[segs]), flat(S0), alpha=-1)          # [n*HV, C, V]
        o_now = torch.bmm(flat(qeG[segs]), flat(S0))
        torch.baddbmm(o_now, flat(A_qk[segs]), delta, out=flat(o_chunks[segs]))
        decayed = flat(eGC[segs].transpose(-1, -2) * S0)                  # [n*HV, K, V], before S0 is overwritten
        torch.baddbmm(decayed, flat(kdec[segs]).transpose(-1, -2), delta, out=flat(state[:size]))
        for j in range(size):
            if s0 + j in slot:
                captured[slot[s0 + j]] = state[j]
        s0 += size
    return o_chunks, state[where.argsort()], captured                     # back to the sequences' order


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None, diagonal=None, group_elements=None, intra=None, recurrence=None,
                o_rows=False):
    """`k3.reference.kda_chunked` (same signature and contract), all chunks' intra-chunk work
    batched; chunk_size must be a multiple of 16 here (the reference takes the others).

    diagonal: the diagonal blocks' function (`diagonal_blocks_torch`'s signature and contract);
    None for the torch einsums. group_elements (default GROUP_ELEMENTS): the floats one phase-1
    group of chunks may hold, counted as the torch diagonal's pairwise decays (a chunk's C / 16
    blocks of [16, 16, K] per head) or, for another diagonal, which is taken to materialise
    nothing, as `working_floats` per chunk. intra: phase 1 whole (`intra_chunk_torch`'s
    signature and contract), in place of the torch one with `diagonal` and `group_elements`.
    recurrence: phase 2 (`recurrence_torch`'s signature
    and contract); None for the torch loop. o_rows: the recurrence writes o itself, straight to
    the packed rows in v's dtype (it takes `out=` [B*T, HV, V] and `out_index=` [nseg, C], as
    `triton_kernels.kda_chunked_recurrence.recurrence` does), in place of the scatter here.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < BLOCK or chunk_size % BLOCK:
        return wy.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets)
    op = "kda_chunked"
    # the contract's errors; the inputs as rows [B*T + 1, HV, *] in the compute dtype, the last
    # row zeros (what padding positions read), written in one pass
    p = prepare_kda_inputs(op, q, k, v, g, beta, scale, initial_state, cu_seqlens, zero_row=True)
    B, T, HV, K, V = p.shape
    bounds, N, dev = p.bounds, len(p.bounds), q.device
    wanted = (None if checkpoint_offsets is None
              else checkpoint_offsets_per_sequence(checkpoint_offsets, [e - s for s, e in bounds], op))
    qf, kf, vf, gf, bf = p.q, p.k, p.v, p.g, p.beta
    segments, order, sizes = _segments(bounds, wanted, chunk_size)
    C = chunk_size
    pad = B * T                                                           # the zero row
    index = torch.full((len(segments), C), pad, dtype=torch.long)
    for s, (_, a, z) in enumerate(segments):
        index[s, : z - a] = torch.arange(a, z)
    index = index.to(dev)

    # phase 1: every chunk's W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)
    if intra is None:
        intra = functools.partial(intra_chunk_torch, diagonal=diagonal, group_elements=group_elements)
    W, U, A_qk, qeG, kdec, eGC = intra(qf, kf, vf, gf, bf, index)

    # phase 2: the recurrence (`recurrence_torch`'s contract), the chunk ends wanted as checkpoints
    capture, slot_of = [], {}
    keep = [set(w) for w in wanted] if wanted else None
    for s, (n, _, z) in enumerate(segments):
        if keep and z - bounds[n][0] in keep[n] and (n, z - bounds[n][0]) not in slot_of:
            slot_of[n, z - bounds[n][0]] = len(capture)
            capture.append(s)
    recurrence = recurrence or recurrence_torch
    if o_rows:                          # o to its rows in the recurrence (padding positions, row B*T, dropped)
        o = torch.empty(B * T, HV, V, dtype=v.dtype, device=dev)
        _, state, captured = recurrence(W, U, A_qk, qeG, kdec, eGC, p.state, order, sizes, capture, out=o,
                                        out_index=index)
        o = o.view(B, T, HV, V)
    else:
        o_chunks, state, captured = recurrence(W, U, A_qk, qeG, kdec, eGC, p.state, order, sizes, capture)
        o = vf.new_empty(B * T + 1, HV, V)
        o[index.reshape(-1)] = o_chunks.permute(0, 2, 1, 3).reshape(-1, HV, V)   # padding lands on the last row
        o = o[:-1].view(B, T, HV, V).to(v.dtype)
    if wanted is None:
        return KDAChunkedOut(o, state)
    at = lambda n, t: p.state[n] if t == 0 else captured[slot_of[n, t]]    # noqa: E731  the state after t tokens
    count = len(wanted[0]) if wanted else 0
    return KDAChunkedOut(o, state, tuple(torch.stack([at(n, wanted[n][c]) for n in range(N)]) for c in range(count)))
