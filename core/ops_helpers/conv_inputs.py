"""The short conv entry's input checks (`k3.plugin.kernels.ShortConv`), shared by the reference
and the torch kernel so both raise the contract's errors alike."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .varlen import checkpoint_offsets_per_sequence, sequence_bounds


@dataclass(frozen=True)
class ConvInputs:
    """weight as [C, W]; each sequence's (bos, eos) rows of x flattened to [B*T, C]; the
    checkpoint offsets per sequence ([N][C'], None when none are asked)."""

    weight: torch.Tensor
    bounds: list[tuple[int, int]]
    offsets: list[list[int]] | None


def check_conv_weight(op: str, x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Raise the contract's ValueError for a malformed x, weight or activation (named for `op`);
    else the weight as [C, W]. Reads nothing on the host."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"{op}: x must be a float tensor [B, T, C]; got {x.dtype} {tuple(x.shape)}")
    C = x.shape[2]
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]                                          # Conv1d's [C, 1, W]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight must be [C, W] or [C, 1, W] with C={C} (x's channels); "
                         f"got {tuple(weight.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"{op}: activation must be 'silu' or None; got {activation!r}")
    return weight


def check_conv_state(op: str, conv_state: torch.Tensor | None, n: int, c: int, w: int) -> None:
    """Raise the contract's ValueError unless conv_state is None or [N, C, W-1]."""
    if conv_state is not None and tuple(conv_state.shape) != (n, c, w - 1):
        raise ValueError(f"{op}: conv_state must be [N, C, W-1] = [{n}, {c}, {w - 1}]; "
                         f"got {tuple(conv_state.shape)}")


def check_conv_inputs(op: str, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None,
                      cu_seqlens: torch.Tensor | None, activation: str | None,
                      checkpoint_offsets: Sequence[int] | torch.Tensor | None) -> ConvInputs:
    """Raise the contract's ValueError for malformed arguments (named for `op`); else the
    normalised weight, sequence bounds and offsets. Reads cu_seqlens and offsets on the host."""
    weight = check_conv_weight(op, x, weight, activation)
    B, T, C = x.shape
    bounds = sequence_bounds(cu_seqlens, B, T, op)
    check_conv_state(op, conv_state, len(bounds), C, weight.shape[1])
    offsets = None
    if checkpoint_offsets is not None:
        offsets = checkpoint_offsets_per_sequence(checkpoint_offsets, [e - b for b, e in bounds], op)
    return ConvInputs(weight, bounds, offsets)
