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
from .kda_intra_chunk import intra_chunk
from .kda_intra_diagonal import diagonal_blocks

GROUP_ELEMENTS = 1 << 28      # floats of the torch phase 1's working tensors per group (1 GiB in fp32)
INTRA_PRECISION = "ieee"            # phase 1's dots
RECURRENCE_PRECISION = "tf32x3"     # phase 2's


def uses_triton(q, k, v, g, beta, initial_state=None) -> bool:
    """Whether these inputs take the Triton diagonal and recurrence: fp32 compute (bf16 / fp16 /
    fp32 inputs) on a CUDA device, or any device under TRITON_INTERPRET=1."""
    if compute_dtype(q, k, v, g, beta, initial_state) == torch.float64:
        return False
    return q.device.type == "cuda" or interpreted()


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None, precision=None, block_v=None):
    """`k3.reference.kda_chunked` (same signature and contract): both phases in Triton where
    `uses_triton`, else the torch prefill as it is. precision: both phases' dots (default
    INTRA_PRECISION and RECURRENCE_PRECISION). block_v: the recurrence's state columns per
    program (None: its default; a launch option for platform tables)."""
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
              checkpoint_offsets=checkpoint_offsets)
    if not uses_triton(q, k, v, g, beta, initial_state):
        return blocked.kda_chunked(q, k, v, g, beta, **kw)
    return blocked.kda_chunked(q, k, v, g, beta, **kw,
                               intra=functools.partial(intra_chunk, precision=precision or INTRA_PRECISION),
                               recurrence=functools.partial(recurrence, precision=precision or RECURRENCE_PRECISION,
                                                           block_v=block_v))


def kda_chunked_tf32x3(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                       checkpoint_offsets=None):
    """`kda_chunked` with both phases' dots in 3xTF32 (experimental `kda_chunked_tf32x3`)."""
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, checkpoint_offsets=checkpoint_offsets, precision="tf32x3")


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
