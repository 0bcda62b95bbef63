"""KDA's depthwise causal short conv in torch: what the reference platform serves as
`kda.short_conv`. `k3.plugin.kernels.ShortConv` is the contract; `k3.reference.short_conv`,
a sum over taps token by token, is its oracle. Equal-length batches (decode: B = N, T = 1) run
as one batched pass; packed sequences one pass each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from k3.dtypes import compute_dtype, upcast
from k3.ops_helpers import check_conv_inputs
from k3.plugin.kernels import ShortConvOut


def _conv_windows(xp: torch.Tensor, w: torch.Tensor, activation: str | None,
                  silu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """xp [n, W-1+L, C] (history then inputs), w [C, W] -> y [n, L, C], same dtype."""
    W = w.shape[1]
    if xp.shape[1] < W:  # an empty sequence
        return xp[:, :0]
    L = xp.shape[1] - (W - 1)
    # tap j reads the input j - (W-1) steps back; shifted slices (not unfold) lower on every
    # backend, torch-xla included
    y = sum(xp[:, j: j + L] * w[:, j] for j in range(W))  # [n, L, C]
    return silu(y) if activation == "silu" else y


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_offsets: Sequence[int] | torch.Tensor | None = None,
    silu: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> ShortConvOut:
    """`ShortConv`: every window as W shifted slices of the history and the inputs. silu: the
    SiLU to apply (an option: the batch-invariant kernels pass their own)."""
    checked = check_conv_inputs("short_conv", x, weight, conv_state, cu_seqlens, activation, checkpoint_offsets)
    weight, bounds, offsets = checked.weight, checked.bounds, checked.offsets               # weight [C, W]
    (B, T, C), N, W = x.shape, len(bounds), weight.shape[1]

    cd = compute_dtype(x, weight, conv_state)
    w = upcast(weight, cd)
    hist = (
        x.new_zeros(N, W - 1, C, dtype=cd)
        if conv_state is None
        else upcast(conv_state, cd).transpose(1, 2)  # [N, W-1, C]
    )
    if cu_seqlens is None:  # all sequences have length T: one batched pass
        xp = torch.cat([hist, upcast(x, cd)], dim=1)  # [B, W-1+T, C]
        y = _conv_windows(xp, w, activation, silu)
        xps = list(xp.unbind(0))
    else:
        xf = upcast(x[0], cd)  # [T, C]
        xps = [torch.cat([hist[n], xf[b:e]]) for n, (b, e) in enumerate(bounds)]  # [W-1+len, C]
        y = torch.cat([_conv_windows(xp[None], w, activation, silu)[0] for xp in xps])[None]  # [1, T, C]

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
