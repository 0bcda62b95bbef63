"""Chunked KDA prefill with both phases in Triton: `KDAKernels.chunked` (see
k3.reference.kda_chunked for the contract). `torch_kernels/kda_chunked_blocked.py`'s two-phase
structure (exact fp32) with
- phase 1, every chunk's intra-chunk work, in one launch (`kda_intra_chunk.intra_chunk`) in
  place of its torch groups of batched matmuls and triangular solves, and
- phase 2, the cross-chunk state recurrence, in one launch (`kda_chunked_recurrence.recurrence`)
  in place of its torch loop of a few batched matmuls per chunk index.
The dots: phase 1 in fp32 FMAs ("ieee", INTRA_PRECISION), phase 2 in 3xTF32 tensor-core
products (RECURRENCE_PRECISION; bench/kda_tf32_sensitivity.py: as accurate as fp32 for this
chain, where plain TF32 is not; its kernel keeps the state in registers: 4.2 ms at 8K tokens and
96 heads on the H200 against 15.4 for the fp32-FMA form; the whole prefill 12.05 ms a layer).
Phase 1's form (INTRA_FORM, `intra_form=`): "blocks" (served, 16-row FMA dots), "split" (three
kernels with wide grids, `kda_chunked_split`, experimental: 9.0 ms on an H100 at 8K tokens and 96
heads against 5.9 for blocks, bench/results/kda_prefill-split-h100-2026-12-06-s22.json) or "mma" (the
64 x 64 products, the block inverse and W, U as whole-chunk 3xTF32 tensor-core dots,
`kda_chunked_mma`, experimental): on an H100 at 8K tokens and 96 heads phase 1 takes 8.85 ms in
the mma form against 5.89 ms in blocks (bench/kda_prefill.py, BENCHMARKS.md 2026-12-06), so
blocks stays served. The recurrence stores o to the token rows itself (O_THROUGH_INDEX; the whole
prefill 10.22 ms there against 11.14 ms with the scatter and cast after it). Phase 2's form
(RECURRENCE_FORM, `recurrence_form=`): "fused" (served, one launch, four dots a chunk in the
chain) or "split" (`kda_chunked_state.recurrence_split`: a state kernel with two dots a chunk,
then the output product fully parallel; `kda_chunked_state_split`, experimental: on an H100
at 8K tokens, o stored to the rows, 2.76 against 2.94 ms for the fused kernel in one run and 3.90
against 3.05 in another, its output launch alone 1.56 ms at 43% of the copy bandwidth,
bench/kda_prefill_ncu.py). Both splits together pass the kda.chunked and model
conformance cases there (49 of 49).

`kda_chunked_triton_diagonal` is the previous served form (measured in bench/kda_prefill.py):
phase 1 in torch with only its diagonal blocks in Triton (`kda_intra_diagonal`).

Inputs whose compute dtype is float64, or on a device Triton cannot run on (a CPU without
TRITON_INTERPRET=1), take the torch phases.
"""

from __future__ import annotations

import functools

import torch

from k3.dtypes import compute_dtype
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked

from . import interpreted
from .kda_chunked_recurrence import recurrence
from .kda_chunked_state import recurrence_split
from .kda_intra_chunk import intra_chunk
from .kda_intra_diagonal import diagonal_blocks

GROUP_ELEMENTS = 1 << 28      # floats of the torch phase 1's working tensors per group (1 GiB in fp32)
INTRA_FORM = "blocks"               # phase 1's kernel (`kda_intra_chunk.intra_chunk`'s form)
INTRA_PRECISION = "ieee"            # phase 1's dots (the "blocks" form's; the "mma" form's default is "tf32x3")
RECURRENCE_PRECISION = "tf32x3"     # phase 2's
RECURRENCE_FORM = "fused"           # phase 2's kernels: "fused" (`recurrence`) or "split" (`recurrence_split`)
O_THROUGH_INDEX = True              # phase 2 writes o to the token rows itself (no scatter and cast after): 0.9 ms of 11.1 at 8K on an H100


def uses_triton(q, k, v, g, beta, initial_state=None) -> bool:
    """Whether these inputs take the Triton diagonal and recurrence: fp32 compute (bf16 / fp16 /
    fp32 inputs) on a CUDA device, or any device under TRITON_INTERPRET=1."""
    if compute_dtype(q, k, v, g, beta, initial_state) == torch.float64:
        return False
    return q.device.type == "cuda" or interpreted()


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None, precision=None, block_v=None, intra_form=None, o_through_index=None,
                recurrence_form=None, diag_columns=None):
    """`k3.reference.kda_chunked` (same signature and contract): both phases in Triton where
    `uses_triton`, else the torch prefill as it is. precision: both phases' dots (default
    INTRA_PRECISION, or the "mma" form's own, and RECURRENCE_PRECISION). block_v: the
    recurrence's state columns per program (None: its default; a launch option for platform
    tables). intra_form: phase 1's kernel, "blocks", "mma" or "split" (default INTRA_FORM).
    o_through_index: the recurrence stores o to the token rows through the chunk index, in v's
    dtype, instead of the scatter and cast after it (default O_THROUGH_INDEX). recurrence_form:
    phase 2's kernels, "fused" (`recurrence`, one launch) or "split" (`recurrence_split`: the
    state kernel, then the output product in a parallel launch; default RECURRENCE_FORM).
    diag_columns: phase 1's diagonal blocks a column at a time (default `kda_intra_chunk.DIAG_COLUMNS`,
    on; False: as [16, 16, slice] decay tensors, the form served until 2026-12-07)."""
    rec_form = recurrence_form or RECURRENCE_FORM
    if rec_form not in ("fused", "split"):
        raise ValueError(f"kda chunked: recurrence_form must be 'fused' or 'split'; got {rec_form!r}")
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
              checkpoint_offsets=checkpoint_offsets)
    if not uses_triton(q, k, v, g, beta, initial_state):
        return blocked.kda_chunked(q, k, v, g, beta, **kw)
    form = intra_form or INTRA_FORM
    return blocked.kda_chunked(q, k, v, g, beta, **kw,
                               intra=functools.partial(intra_chunk, form=form, precision=precision or (
                                   INTRA_PRECISION if form == "blocks" else None), diag_columns=diag_columns),
                               recurrence=functools.partial(recurrence if rec_form == "fused" else recurrence_split,
                                                           precision=precision or RECURRENCE_PRECISION,
                                                           block_v=block_v),
                               o_rows=O_THROUGH_INDEX if o_through_index is None else o_through_index)


def kda_chunked_tf32x3(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                       checkpoint_offsets=None):
    """`kda_chunked` with both phases' dots in 3xTF32 (experimental `kda_chunked_tf32x3`)."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, precision="tf32x3")


def kda_chunked_mma(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                    checkpoint_offsets=None):
    """`kda_chunked` with phase 1's "mma" form (whole-chunk 3xTF32 tensor-core dots), the
    recurrence as served (3xTF32)."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, intra_form="mma")


def kda_chunked_state_split(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                            checkpoint_offsets=None):
    """`kda_chunked` with phase 2 split (`kda_chunked_state.recurrence_split`: the state kernel
    walks the chunks with two 3xTF32 dots a step, then the output product runs in a parallel
    launch), phase 1 as served."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, recurrence_form="split")


def kda_chunked_split(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                      checkpoint_offsets=None):
    """`kda_chunked` with phase 1's "split" form (`kda_intra_split`: three kernels with wide grids,
    its wide dots in 3xTF32), the recurrence as served (3xTF32)."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, intra_form="split")


def kda_chunked_splits(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                       checkpoint_offsets=None):
    """`kda_chunked` with both phases split: phase 1's "split" form and phase 2's "split" form
    (`kda_chunked_split` and `kda_chunked_state_split` together)."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, intra_form="split",
                       recurrence_form="split")


def kda_chunked_triton_diagonal(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                                checkpoint_offsets=None):
    """The previous served form, for benchmarks: phase 1 in torch groups with the Triton diagonal
    blocks, phase 2 in Triton (exact fp32)."""
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
              checkpoint_offsets=checkpoint_offsets)
    if not uses_triton(q, k, v, g, beta, initial_state):
        return blocked.kda_chunked(q, k, v, g, beta, **kw)
    return blocked.kda_chunked(q, k, v, g, beta, **kw, diagonal=diagonal_blocks, group_elements=GROUP_ELEMENTS,
                               recurrence=recurrence)
