"""Packed-sequence conventions shared by the reference and the kernels: KDA's `cu_seqlens`
(B = 1, N sequences packed along T), checkpoint offsets, chunk boundaries, and the MLA /
indexer rule for `cu_seqlens_q` / `cu_seqlens_kv`. Every helper reads the boundaries on the
host (prefill paths only) and raises the contract's `ValueError`s, named for the calling op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sequence_bounds(
    cu_seqlens: torch.Tensor | None, B: int, T: int, op: str
) -> list[tuple[int, int]]:
    """[(bos, eos)] of each sequence, as rows of the inputs flattened to [B*T, ...].

    Without `cu_seqlens` there are N = B sequences of length T. With it (integer tensor
    [N+1], starting at 0, non-decreasing, last == T) B must be 1. Reads cu_seqlens on host.
    """
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"{op}: cu_seqlens must be an integer tensor [N+1] with N >= 1; "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch size B must be 1 (packed); got B={B}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(
            f"{op}: cu_seqlens must start at 0, be non-decreasing and end at T={T}; got {cu}"
        )
    return list(zip(cu[:-1], cu[1:]))


def checkpoint_offsets_per_sequence(
    checkpoint_offsets: Sequence[int] | torch.Tensor, lengths: list[int], op: str
) -> list[list[int]]:
    """Offsets as a python list [N][C]; each offset checked to lie in [0, len_n].

    checkpoint_offsets: a sequence of ints (or a 1-D integer tensor) shared by every
    sequence, or an integer tensor [N, C] with per-sequence offsets.
    """
    N = len(lengths)
    if isinstance(checkpoint_offsets, torch.Tensor):
        if checkpoint_offsets.is_floating_point() or checkpoint_offsets.dim() not in (1, 2):
            raise ValueError(
                f"{op}: checkpoint_offsets must be ints [C] or an integer tensor [N={N}, C]; "
                f"got {checkpoint_offsets.dtype} {tuple(checkpoint_offsets.shape)}"
            )
        if checkpoint_offsets.dim() == 2 and checkpoint_offsets.shape[0] != N:
            raise ValueError(
                f"{op}: checkpoint_offsets tensor must be [N={N}, C]; "
                f"got {tuple(checkpoint_offsets.shape)}"
            )
        offs = checkpoint_offsets.tolist()
    else:
        offs = list(checkpoint_offsets)
    per_seq = [list(o) for o in offs] if offs and isinstance(offs[0], list) else [offs] * N
    if len(per_seq) != N or len({len(row) for row in per_seq}) > 1:
        raise ValueError(f"{op}: per-sequence checkpoint_offsets must be [N={N}, C]; got {offs}")
    for n, (row, length) in enumerate(zip(per_seq, lengths)):
        for o in row:
            if int(o) != o or not 0 <= o <= length:
                raise ValueError(
                    f"{op}: checkpoint offset {o} of sequence {n} is outside [0, {length}] "
                    f"(that sequence's length)"
                )
    return [[int(o) for o in row] for row in per_seq]


def chunk_cuts(length: int, chunk_size: int, offsets: Sequence[int] = ()) -> list[int]:
    """The chunk boundaries of a sequence of `length` tokens: every chunk_size tokens from its
    start, and at each checkpoint offset (0 and length included, sorted, once each)."""
    return sorted({0, length, *range(0, length, chunk_size), *offsets})


def varlen_spans(
    cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, *, num_q: int, num_kv: int, op: str
) -> list[tuple[int, int, int, int]]:
    """[(q_start, q_end, kv_start, kv_end)] per sequence, checked on the host.

    cu_seqlens_q, cu_seqlens_kv: integer [N+1], from 0, non-decreasing, ending at num_q / num_kv,
    with q_len_n <= kv_len_n.
    """
    cus = []
    for name, cu, total in (
        ("cu_seqlens_q", cu_seqlens_q, num_q),
        ("cu_seqlens_kv", cu_seqlens_kv, num_kv),
    ):
        if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
            raise ValueError(
                f"{op}: {name} must be an integer tensor [N+1]; got {cu.dtype} {tuple(cu.shape)}"
            )
        c = [int(v) for v in cu.tolist()]
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(
                f"{op}: {name} must start at 0, be non-decreasing and end at {total}; got {c}"
            )
        cus.append(c)
    cq, ck = cus
    if len(cq) != len(ck):
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_kv must both be [N+1]; got {len(cq)} vs {len(ck)}"
        )
    spans = list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))
    for n, (q0, q1, k0, k1) in enumerate(spans):
        if q1 - q0 > k1 - k0:
            raise ValueError(f"{op}: sequence {n} has q_len {q1 - q0} > kv_len {k1 - k0}")
    return spans
