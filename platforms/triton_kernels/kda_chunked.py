"""Chunked KDA prefill on fla-core's Triton `chunk_kda`: `KDAKernels.chunked` (see
k3.reference.kda_chunked for the contract).

fla-core computes the outputs and the final state of ragged sequences in one call, but keeps
no state at arbitrary offsets. Checkpoints (the KDA states prefix caching keeps, DESIGN.md
"Cache") are emitted inside the same pass by cutting each sequence at its checkpoint offsets
and running the pieces in rounds: round r runs piece r of every sequence that has one, from the
state the previous round ended in, and the state it ends in is the checkpoint. Without
offsets it is one call on the caller's tensors. A round that takes one sequence works on views;
a round over several gathers their pieces (a copy of q, k, v, g and beta of those tokens).

Inputs fla-core does not take (float64, key dims over 256) go to the reference op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3 import reference as ref
from k3.reference.conv import checkpoint_offsets_per_sequence

# fla_call(q, k, v, g, beta, scale, initial_state [N, HV, K, V] fp32, cu_seqlens [N+1] int64 | None)
#   -> (o [1, T, HV, V], final_state [N, HV, K, V] fp32)
FlaCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def fla_chunk_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """One call of fla-core's chunk_kda in k3's conventions (g log decay, beta after sigmoid)."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                     cu_seqlens=cu_seqlens)


def covers(q, v) -> bool:
    return q.dtype in (torch.bfloat16, torch.float16, torch.float32) and q.shape[-1] <= 256 and v.dtype == q.dtype


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None, fla_call: FlaCall | None = None):
    """`k3.reference.kda_chunked` on fla-core's kernels (same signature and contract).

    chunk_size is the reference's knob; fla-core picks its own chunking (the result is the
    same function). fla_call: the per-round kernel, replaceable in tests.
    """
    if not covers(q, v):
        return ref.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets)
    call = fla_call or fla_chunk_kda
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    else:
        edges = cu_seqlens.tolist()
        bounds = list(zip(edges[:-1], edges[1:]))
    n = len(bounds)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    state = (torch.zeros(n, HV, K, V, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.to(torch.float32))
    if checkpoint_offsets is None:
        cu = torch.tensor([0] + [e for _, e in bounds], dtype=torch.int64, device=q.device)
        o, final = call(*flat, scale, state, cu)
        return o.reshape(B, T, HV, V).to(v.dtype), final

    lengths = [e - b for b, e in bounds]
    wanted = checkpoint_offsets_per_sequence(checkpoint_offsets, lengths, "kda_chunked")
    cuts = [sorted({0, length, *offs}) for length, offs in zip(lengths, wanted)]
    at = [{0: state[i]} for i in range(n)]                # state after `offset` tokens, per sequence
    o = flat[2].new_empty(1, B * T, HV, V)
    for r in range(max(len(c) for c in cuts) - 1):
        pieces = [(i, bounds[i][0] + c[r], bounds[i][0] + c[r + 1]) for i, c in enumerate(cuts) if len(c) > r + 1]
        seqs = torch.tensor([i for i, _, _ in pieces], device=q.device)
        if len(pieces) == 1:
            _, a, z = pieces[0]
            part = [x[:, a:z] for x in flat]
            rows = slice(a, z)
        else:
            rows = torch.cat([torch.arange(a, z, device=q.device) for _, a, z in pieces])
            part = [x[:, rows] for x in flat]
        cu = torch.tensor([0, *torch.tensor([z - a for _, a, z in pieces]).cumsum(0).tolist()], dtype=torch.int64,
                          device=q.device)
        o_part, s_part = call(*part, scale, state[seqs], cu)
        o[:, rows] = o_part.to(o.dtype)
        state = state.index_copy(0, seqs, s_part.to(torch.float32))
        for j, (i, a, z) in enumerate(pieces):
            at[i][z - bounds[i][0]] = s_part[j]
    checkpoints = [torch.stack([at[i][offs[c]] for i, offs in enumerate(wanted)])
                   for c in range(len(wanted[0]) if wanted else 0)]
    return o.reshape(B, T, HV, V).to(v.dtype), state, checkpoints
