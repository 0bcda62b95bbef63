"""Chunked KDA prefill in torch with the diagonal blocks and the recurrence in Triton:
`KDAKernels.chunked` (see k3.reference.kda_chunked for the contract).
`torch_kernels/kda_chunked_blocked.py` (exact fp32, every chunk's intra-chunk work batched)
with `kda_intra_diagonal.diagonal_blocks` in place of its torch einsums, which built each
diagonal block's [16, 16, K] pairwise decays, and `kda_chunked_recurrence.recurrence` (phase 2,
the cross-chunk state recurrence, in one launch) in place of its torch loop of a few batched
matmuls per chunk index.

With nothing of the decays materialised, what a phase-1 group of chunks holds is its working
tensors (`working_floats` per chunk), so the groups are bounded by GROUP_ELEMENTS of those:
at K3's dimensions (96 heads, K = V = 128, chunks of 64) 22 chunks a group against the torch
diagonal's 10, for about the same transient memory (~1 GiB by the count of tensors held).

Inputs whose compute dtype is float64, or on a device Triton cannot run on (a CPU without
TRITON_INTERPRET=1), take the torch diagonal, its group bound and the torch recurrence.
"""

from __future__ import annotations

import torch

from k3.dtypes import compute_dtype
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked

from . import interpreted
from .kda_chunked_recurrence import recurrence
from .kda_intra_diagonal import diagonal_blocks

GROUP_ELEMENTS = 1 << 28      # floats of phase 1's working tensors per group (1 GiB in fp32)


def uses_triton(q, k, v, g, beta, initial_state=None) -> bool:
    """Whether these inputs take the Triton diagonal and recurrence: fp32 compute (bf16 / fp16 /
    fp32 inputs) on a CUDA device, or any device under TRITON_INTERPRET=1."""
    if compute_dtype(q, k, v, g, beta, initial_state) == torch.float64:
        return False
    return q.device.type == "cuda" or interpreted()


def kda_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size=64,
                checkpoint_offsets=None):
    """`k3.reference.kda_chunked` (same signature and contract): the batched torch prefill with
    the Triton diagonal blocks and recurrence where `uses_triton`, else the torch one as it is."""
    kw = dict(scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
              checkpoint_offsets=checkpoint_offsets)
    if not uses_triton(q, k, v, g, beta, initial_state):
        return blocked.kda_chunked(q, k, v, g, beta, **kw)
    return blocked.kda_chunked(q, k, v, g, beta, **kw, diagonal=diagonal_blocks, group_elements=GROUP_ELEMENTS,
                               recurrence=recurrence)
