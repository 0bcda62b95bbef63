"""Depthwise causal short convolution (KDA's q/k/v conv) and the packed-sequence helpers.

The helpers `sequence_bounds` and `checkpoint_offsets_per_sequence` are shared with
`kda.py`: both ops take the same `cu_seqlens` and `checkpoint_offsets` conventions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3.plugin.kernels import ShortConvOut

from ..dtypes import compute_dtype, upcast


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


def _conv_windows(xp: torch.Tensor, w: torch.Tensor, activation: str | None) -> torch.Tensor:
    """xp [n, W-1+L, C] (history then inputs), w [C, W] -> y [n, L, C], same dtype."""
    W = w.shape[1]
    if xp.shape[1] < W:  # an empty sequence
        return xp[:, :0]
    L = xp.shape[1] - (W - 1)
    # tap j reads the input j - (W-1) steps back; shifted slices (not unfold) lower on every
    # backend, torch-xla included
    y = sum(xp[:, j: j + L] * w[:, j] for j in range(W))  # [n, L, C]
    return F.silu(y) if activation == "silu" else y


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_offsets: Sequence[int] | torch.Tensor | None = None,
) -> ShortConvOut:
    """Depthwise causal conv with cached history: y_t[c] = act(sum_j w[c, j] x_{t-W+1+j}[c]).

    x: [B, T, C] (with `cu_seqlens` [N+1]: B = 1, N sequences packed along T; else N = B).
    weight: [C, W] or [C, 1, W] (torch Conv1d layout), no bias; tap W-1 is the current token.
    conv_state: [N, C, W-1], the last W-1 pre-conv inputs before each sequence, oldest first
        (zeros if None). activation: "silu" or None.
    checkpoint_offsets: see `checkpoint_offsets_per_sequence`; checkpoint c of sequence n is
        the window after offset tokens (offset 0 = conv_state).
    The products and sums are computed in fp32 (fp64 if any input is float64).
    Returns (y [B, T, C] in x.dtype, final_conv_state [N, C, W-1] in x.dtype), plus a list of
    C checkpoint tensors [N, C, W-1] (x.dtype) when checkpoint_offsets is given. A sequence
    shorter than W-1 keeps the newest part of its old state.
    """
    op = "short_conv"
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(
            f"{op}: x must be a float tensor [B, T, C]; got {x.dtype} {tuple(x.shape)}"
        )
    B, T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(
            f"{op}: weight must be [C, W] or [C, 1, W] with C={C} (x's channels); "
            f"got {tuple(weight.shape)}"
        )
    W = weight.shape[1]
    if activation not in ("silu", None):
        raise ValueError(f"{op}: activation must be 'silu' or None; got {activation!r}")
    bounds = sequence_bounds(cu_seqlens, B, T, op)
    N = len(bounds)
    if conv_state is not None and tuple(conv_state.shape) != (N, C, W - 1):
        raise ValueError(
            f"{op}: conv_state must be [N, C, W-1] = [{N}, {C}, {W - 1}]; "
            f"got {tuple(conv_state.shape)}"
        )
    offsets = None
    if checkpoint_offsets is not None:
        offsets = checkpoint_offsets_per_sequence(
            checkpoint_offsets, [e - b for b, e in bounds], op
        )

    cd = compute_dtype(x, weight, conv_state)
    w = upcast(weight, cd)
    hist = (
        x.new_zeros(N, W - 1, C, dtype=cd)
        if conv_state is None
        else upcast(conv_state, cd).transpose(1, 2)  # [N, W-1, C]
    )
    if cu_seqlens is None:  # all sequences have length T: one batched pass
        xp = torch.cat([hist, upcast(x, cd)], dim=1)  # [B, W-1+T, C]
        y = _conv_windows(xp, w, activation)
        xps = list(xp.unbind(0))
    else:
        xf = upcast(x[0], cd)  # [T, C]
        xps = [torch.cat([hist[n], xf[b:e]]) for n, (b, e) in enumerate(bounds)]  # [W-1+len, C]
        y = torch.cat([_conv_windows(xp[None], w, activation)[0] for xp in xps])[None]  # [1, T, C]

    def window(n: int, t: int) -> torch.Tensor:  # [C, W-1]: the W-1 inputs before token t
        return xps[n][t : t + W - 1].transpose(0, 1)

    final = torch.stack([window(n, e - b) for n, (b, e) in enumerate(bounds)]).to(x.dtype)
    if offsets is None:
        return ShortConvOut(y.to(x.dtype), final)
    n_ckpt = len(offsets[0])
    checkpoints = tuple(
        torch.stack([window(n, offsets[n][c]) for n in range(N)]).to(x.dtype) for c in range(n_ckpt)
    )
    return ShortConvOut(y.to(x.dtype), final, checkpoints)
