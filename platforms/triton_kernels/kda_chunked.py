"""Chunked KDA prefill on fla-core's Triton `chunk_kda`: `KDAKernels.chunked` (see
k3.reference.kda_chunked for the contract).

fla-core computes the outputs and the final state of ragged sequences in one call, but keeps
no state at arbitrary offsets. Checkpoints (the KDA states prefix caching keeps, DESIGN.md
"Cache") are emitted inside the same pass by cutting each sequence at its checkpoint offsets
and running the pieces in rounds: round r runs piece r of every sequence that has one, from the
state the previous round ended in, and the state it ends in is the checkpoint. Without
offsets it is one call on the caller's tensors. A round that takes one sequence works on views;
a round over several gathers their pieces (a copy of q, k, v, g and beta of those tokens). The cutting is planned once per forward (`round_plan`) and
shared by its KDA layers.

Inputs fla-core does not take (float32 and float64, key dims over 256) go to the reference op.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3.ops_helpers import checkpoint_offsets_per_sequence
from k3.platforms.torch_kernels import kda_chunked as torch_chunked
from k3.plugin.kernels import KDAChunkedOut

from . import fla_configs

# fla_call(q, k, v, g, beta, scale, initial_state [N, HV, K, V] fp32, cu_seqlens [N+1] int64 | None)
#   -> (o [1, T, HV, V], final_state [N, HV, K, V] fp32)
FlaCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


OPERANDS_ENV = "K3_FLA_KDA_OPERANDS"


def operand_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype fla-core's chunk_kda gets q, k and v in, for a model of `dtype` (bf16 / fp16).

    fla-core's dots take their operands' dtype, and it keeps the per-chunk states and the
    corrected values in that dtype too. fp32 operands (TF32 tensor cores, fp32 per-chunk states)
    are the default; K3_FLA_KDA_OPERANDS=bf16 takes the model's dtype (half the bytes and twice the
    MMA rate: 2.76 vs 5.64 ms at 8K tokens on the H200). Neither passes every bf16 model case on
    the H200 (k3-tiny greedy: a token 4.03 logits from the float64 oracle's choice with fp32
    operands, 5.41 with bf16, margin 4): TF32 rounds the fp32 chunk-state chain (state error ratio
    7.9e-4), which is why this kernel stays experimental (BENCHMARKS.md, fifth session)."""
    choice = os.environ.get(OPERANDS_ENV, "fp32")
    if choice not in ("fp32", "bf16"):
        raise ValueError(f"{OPERANDS_ENV} must be fp32 or bf16, got {choice!r}")
    return torch.float32 if choice == "fp32" else dtype


def fla_chunk_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """One call of fla-core's chunk_kda in k3's conventions (g log decay, beta after sigmoid), with
    k3's tuned launch configurations for this GPU where it ships them (fla_configs.py), q / k / v
    in `operand_dtype`; o comes back in that dtype (the wrapper casts it to the model's)."""
    fla_configs.pin()
    from fla.ops.kda import chunk_kda

    operands = operand_dtype(v.dtype)
    q, k, v = (x.to(operands) for x in (q, k, v))
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                     cu_seqlens=cu_seqlens)


FLA_DTYPES = (torch.bfloat16, torch.float16)


def covers(q, v) -> bool:
    """bf16 / fp16 inputs with head dims fla-core takes. float32 goes to the reference: fla-core's
    dots round fp32 operands to TF32, whose 1e-3 error fails the fp32 model conformance (a
    0.0007-0.019 error ratio on the tiny models' logits, H200, against a 1.7e-5 tolerance)."""
    return q.dtype in FLA_DTYPES and q.shape[-1] <= 256 and v.dtype == q.dtype


@dataclass
class RoundPlan:
    """How one forward's sequences are cut: computed once (host reads of cu_seqlens and the
    offsets) and reused by every KDA layer of the forward, which also hands fla-core the same
    `cu_seqlens` tensors each time, so its per-tensor cache of chunk indices hits."""

    bounds: list[tuple[int, int]]                 # [N] (start, end) in the packed axis
    wanted: list[list[int]] | None                # [N][C] checkpoint offsets, None: no checkpoints
    cu: torch.Tensor                              # [N+1] int64, the whole batch (no checkpoints)
    rounds: list[tuple[list[tuple[int, int, int]], torch.Tensor, slice | torch.Tensor, torch.Tensor]]
    # per round: pieces (sequence, start, end), sequence ids [n_r], rows (slice or [tokens]), cu [n_r+1]


_plans: dict[tuple, tuple] = {}                   # key -> (weak references to the tensors keyed by id, plan)


def _identity(x):
    """A tensor by identity (the same object, alive); anything else (ints, lists) by value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    return ("value", None if x is None else tuple(x))


def round_plan(cu_seqlens, checkpoint_offsets, batch: int, length: int, device) -> RoundPlan:
    key = (_identity(cu_seqlens), _identity(checkpoint_offsets), batch, length, str(device))
    tensors = [x for x in (cu_seqlens, checkpoint_offsets) if isinstance(x, torch.Tensor)]
    cached = _plans.get(key)
    if cached is not None and all(ref_() is x for ref_, x in zip(cached[0], tensors)):
        return cached[1]
    if cu_seqlens is None:
        bounds = [(b * length, (b + 1) * length) for b in range(batch)]
    else:
        edges = cu_seqlens.tolist()
        bounds = list(zip(edges[:-1], edges[1:]))
    cu = (cu_seqlens if cu_seqlens is not None and cu_seqlens.dtype == torch.int64 and cu_seqlens.device == device
          else torch.tensor([0] + [e for _, e in bounds], dtype=torch.int64, device=device))
    wanted, rounds = None, []
    if checkpoint_offsets is not None:
        lengths = [e - b for b, e in bounds]
        wanted = checkpoint_offsets_per_sequence(checkpoint_offsets, lengths, "kda_chunked")
        cuts = [sorted({0, n, *offs}) for n, offs in zip(lengths, wanted)]
        for r in range(max(len(c) for c in cuts) - 1):
            pieces = [(i, bounds[i][0] + c[r], bounds[i][0] + c[r + 1]) for i, c in enumerate(cuts) if len(c) > r + 1]
            seqs = torch.tensor([i for i, _, _ in pieces], device=device)
            if len(pieces) == 1:
                rows = slice(pieces[0][1], pieces[0][2])
            else:
                rows = torch.cat([torch.arange(a, z, device=device) for _, a, z in pieces])
            sizes = torch.tensor([z - a for _, a, z in pieces]).cumsum(0).tolist()
            rounds.append((pieces, seqs, rows, torch.tensor([0, *sizes], dtype=torch.int64, device=device)))
    plan = RoundPlan(bounds, wanted, cu, rounds)
    refs = tuple(weakref.ref(x) for x in tensors)
    _plans.clear()                                # one forward at a time: keep only the latest plan
    _plans[key] = (refs, plan)
    return plan


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None, fla_call: FlaCall | None = None):
    """`k3.reference.kda_chunked` on fla-core's kernels (same signature and contract).

    chunk_size is the reference's knob; fla-core picks its own chunking (the result is the
    same function). fla_call: the per-round kernel, replaceable in tests.
    """
    if not covers(q, v):
        return torch_chunked.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                               chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets)
    call = fla_call or fla_chunk_kda
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    plan = round_plan(cu_seqlens, checkpoint_offsets, B, T, q.device)
    n = len(plan.bounds)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    state = (torch.zeros(n, HV, K, V, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.to(torch.float32))
    if plan.wanted is None:
        o, final = call(*flat, scale, state, plan.cu)
        return KDAChunkedOut(o.reshape(B, T, HV, V).to(v.dtype), final)

    at = [{0: state[i]} for i in range(n)]                # state after `offset` tokens, per sequence
    o = flat[2].new_empty(1, B * T, HV, V)
    for pieces, seqs, rows, cu in plan.rounds:
        part = [x[:, rows] for x in flat]
        o_part, s_part = call(*part, scale, state[seqs], cu)
        o[:, rows] = o_part.to(o.dtype)
        state = state.index_copy(0, seqs, s_part.to(torch.float32))
        for j, (i, a, z) in enumerate(pieces):
            at[i][z - plan.bounds[i][0]] = s_part[j]
    checkpoints = tuple(torch.stack([at[i][offs[c]] for i, offs in enumerate(plan.wanted)])
                        for c in range(len(plan.wanted[0]) if plan.wanted else 0))
    return KDAChunkedOut(o.reshape(B, T, HV, V).to(v.dtype), state, checkpoints)
