"""Block Attention Residuals kernel entries: `AttnResKernels`.

Per token the sources are the completed block vectors plus the running partial sum; keys are
the RMS-normalised sources, values the raw sources, and the logit weight is one folded vector
u = res_norm.weight * res_proj.weight per mix (no temperature, no 1/sqrt(D)). The block bank
lives only inside one forward pass. The integers are host values fixed per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class AttnResOut:
    """h `[T, D]` the (normalised) mix the next sublayer reads; prefix `[T, D]` the running
    partial sum after the add. Both in the activation dtype."""

    h: Tensor
    prefix: Tensor


class AttnResMix(Protocol):
    """`attn_res.mix`: the softmax mix over sources `[S, T, D]` (blocks, then the partial sum):
    logit[s, t] = u . V[s, t] / sqrt(mean(V[s, t]^2) + eps), softmax over s, weighted sum of the
    raw values. query u `[D]`. Returns `[T, D]` in sources.dtype (the official model rounds the
    mix before the following RMSNorm); fp32 inside (fp64 for float64)."""

    def __call__(self, sources: Tensor, query: Tensor, *, eps: float) -> Tensor: ...


class AttnResStep(Protocol):
    """`attn_res.step`: the fused step.

    prefix `[T, D]` running partial block sum; delta `[T, D]` the last sublayer output not yet
    added, or None; blocks `[T, NB, D]` the block bank, the only argument written (in place).
    1. prefix = prefix + delta, rounded to the activation dtype;
    2. if write_index is not None: blocks[:, write_index] = prefix;
    3. h = prefix if num_visible_blocks == 0, else mix(blocks[:, :num_visible_blocks] + [prefix],
       query, eps);
    4. h = rms_norm(h, out_norm_weight, out_eps) when out_norm_weight is given.
    Returns `AttnResOut`.
    """

    def __call__(self, prefix: Tensor, delta: Tensor | None, blocks: Tensor, *, query: Tensor,
                 num_visible_blocks: int, write_index: int | None, eps: float, out_norm_weight: Tensor | None,
                 out_eps: float) -> AttnResOut: ...
