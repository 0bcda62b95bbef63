"""KDA's depthwise causal short convolution, the oracle: one sequence and one token at a time.

The contract is `k3.plugin.kernels.ShortConv`: y_t[c] = act(sum_j w[c, j] x_{t-W+1+j}[c]), the
W-1 inputs before a sequence coming from its conv state. The reference platform serves
`k3.platforms.torch_kernels.short_conv`, which conformance checks against this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import check_conv_inputs
from k3.plugin.kernels import ShortConvOut


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_offsets: Sequence[int] | torch.Tensor | None = None,
) -> ShortConvOut:
    """Oracle of `ShortConv`: per sequence, its history then its inputs in one row list; token
    i's window is rows i .. i+W-1 of it, and the state after m tokens is rows m .. m+W-2."""
    checked = check_conv_inputs("short_conv", x, weight, conv_state, cu_seqlens, activation, checkpoint_offsets)
    (B, T, C), W = x.shape, checked.weight.shape[1]
    cd = compute_dtype(x, weight, conv_state)
    w = upcast(checked.weight, cd)                                     # [C, W]
    rows = upcast(x, cd).reshape(B * T, C)
    y = rows.new_zeros(B * T, C)
    finals, kept = [], []
    for n, (bos, eos) in enumerate(checked.bounds):
        history = rows.new_zeros(W - 1, C) if conv_state is None else upcast(conv_state[n], cd).T   # [W-1, C]
        seq = torch.cat([history, rows[bos:eos]])                      # [W-1+len, C], oldest first
        for i in range(eos - bos):
            window = seq[i: i + W]                                     # [W, C]: tap W-1 is token i
            acc = (window.T * w).sum(-1)                               # [C]
            y[bos + i] = F.silu(acc) if activation == "silu" else acc
        state_after = lambda m: seq[m: m + W - 1].T                    # noqa: E731  [C, W-1] after m tokens
        finals.append(state_after(eos - bos))
        kept.append([state_after(m) for m in (checked.offsets[n] if checked.offsets else [])])
    columns = len(checked.offsets[0]) if checked.offsets else 0
    checkpoints = tuple(torch.stack([row[c] for row in kept]).to(x.dtype) for c in range(columns))
    return ShortConvOut(y.view(B, T, C).to(x.dtype), torch.stack(finals).to(x.dtype), checkpoints)
