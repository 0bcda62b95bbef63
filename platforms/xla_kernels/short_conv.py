"""KDA's short conv for XLA: `KDAKernels.short_conv` for packed sequences and checkpoints
without host reads.

`k3.plugin.kernels.ShortConv` is the contract, `k3.reference.short_conv` its oracle; the
reference platform's torch kernel (`torch_kernels.short_conv`) reads `cu_seqlens` and the
checkpoint offsets on the host and cuts one pass per sequence. Here the inputs are the rows of
one table, every sequence's old window (`conv_state`, W-1 rows each) then the packed tokens,
and every tap of every token, every final window and every checkpoint window is a row index
into it computed by device arithmetic (`varlen.token_sequences`): a row inside the sequence
when the position is >= 0, else the sequence's old window. Equal-length batches (no
`cu_seqlens`) are packed sequences of T tokens each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import check_conv_state, check_conv_weight
from k3.plugin.kernels import ShortConvOut

from . import varlen


def _check(x, weight, conv_state, cu_seqlens, activation):
    """The contract's checks without a host read: the weight as [C, W], N sequences, W taps."""
    op = "short_conv"
    weight = check_conv_weight(op, x, weight, activation)
    B, T, C = x.shape
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"{op}: with cu_seqlens, B must be 1; got {B}")
    N, W = (B if cu_seqlens is None else cu_seqlens.shape[0] - 1), weight.shape[1]
    check_conv_state(op, conv_state, N, C, W)
    return weight, N, W


def short_conv(x: torch.Tensor, weight: torch.Tensor, *, conv_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu",
               checkpoint_offsets: Sequence[int] | torch.Tensor | None = None) -> ShortConvOut:
    """`ShortConv` by row gathers from [old windows | packed tokens] (the module docstring)."""
    weight, N, W = _check(x, weight, conv_state, cu_seqlens, activation)
    B, T, C = x.shape
    dev, cd = x.device, compute_dtype(x, weight, conv_state)
    w = upcast(weight, cd)                                                        # [C, W]
    P = B * T                                                                     # packed tokens
    if cu_seqlens is None:
        cu = torch.arange(N + 1, device=dev) * T
    else:
        cu = cu_seqlens.to(torch.long)
    seq, pos = varlen.token_sequences(cu, P)
    H = W - 1
    hist = (torch.zeros(N * H, C, dtype=cd, device=dev) if conv_state is None
            else upcast(conv_state, cd).transpose(1, 2).reshape(N * H, C))       # [N*(W-1), C] oldest first
    table = torch.cat([hist, upcast(x.reshape(P, C), cd), hist.new_zeros(1, C)])  # last row: zeros
    start = cu[:-1]

    def rows(n, p):
        """Table rows of relative position p (may be < 0: the old window) of sequences n."""
        inside = H * N + start[n.clamp(max=N - 1)] + p
        old = n.clamp(max=N - 1) * H + H + p
        return torch.where(p >= 0, inside, old)

    live = seq < N
    n_tok = seq.clamp(max=N - 1)
    y = 0
    for j in range(W):                                                            # tap j reads j - (W-1) back
        r = torch.where(live, rows(n_tok, pos + j - H), table.shape[0] - 1)
        y = y + table[r] * w[:, j]
    y = F.silu(y) if activation == "silu" else y
    y = torch.where(live[:, None], y, 0.0).view(B, T, C).to(x.dtype)

    taps = torch.arange(H, device=dev)

    def windows(n, at):                                                           # [M, C, W-1] before position `at`
        return table[rows(n[:, None], at[:, None] - H + taps[None, :])].transpose(1, 2)

    seqs = torch.arange(N, device=dev)
    final = windows(seqs, varlen.lengths(cu)).to(x.dtype)
    if checkpoint_offsets is None:
        return ShortConvOut(y, final)
    offs = (checkpoint_offsets.to(device=dev, dtype=torch.long) if isinstance(checkpoint_offsets, torch.Tensor)
            else torch.tensor([int(o) for o in checkpoint_offsets], dtype=torch.long, device=dev))
    if offs.dim() == 1:
        offs = offs[None].expand(N, offs.shape[0])
    return ShortConvOut(y, final, tuple(windows(seqs, offs[:, c]).to(x.dtype) for c in range(offs.shape[1])))
