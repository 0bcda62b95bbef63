"""MXFP4 expert stacks stored tile by tile: the layout a platform's MoE kernels may stream.

The checkpoint layout (`MXFP4Tensor` over [E, N, K]: codes [E, N, K/2], scales [E, N, K/32])
keeps each weight row contiguous. A kernel that owns 128 rows and steps along them 64 columns at
a time then reads 32 code bytes from each of 128 rows a step, rows K/2 bytes apart: on an H100
that pattern streams at 62% of the copy bandwidth, the same bytes laid out tile by tile at 98%
(issue 27, BENCHMARKS.md). A `TileMajorMXFP4` holds the same codes and scales as

    codes  [E, N/128, K/64, 128, 32] uint8   tile (n, k): rows 128n.., columns 64k..
    scales [E, N/128, K/64, 128, 2]  uint8

It is an `MXFP4Tensor` with the logical shape [E, N, K]: `dequantize` (whole, or by expert)
gives what the checkpoint layout gives, so every reference op and torch kernel computes the same
function from it; code that reads `packed` / `scales` itself must check for this type
(`checkpoint_layout` converts back). A platform repacks a model's experts into it at load
(`k3.model.ffn.MoE.hold_experts_tile_major`, from its `k3_process_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mxfp4 import MXFP4Tensor

TILE_ROWS = 128         # weight rows a tile
TILE_COLS = 64          # columns a tile: 32 code bytes and 2 scale bytes a row


@dataclass(eq=False)
class TileMajorMXFP4(MXFP4Tensor):
    """An MXFP4 expert stack [E, N, K] stored tile by tile (module docstring): packed
    [E, N/128, K/64, 128, 32], scales [E, N/128, K/64, 128, 2]; `shape` is the logical [E, N, K]."""

    def __post_init__(self) -> None:
        p, s = self.packed, self.scales
        if p.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise ValueError(f"TileMajorMXFP4: packed and scales must be uint8, got {p.dtype} and {s.dtype}")
        if p.dim() != 5 or tuple(p.shape[3:]) != (TILE_ROWS, TILE_COLS // 2) \
                or tuple(s.shape) != (*p.shape[:4], TILE_COLS // 32):
            raise ValueError(f"TileMajorMXFP4: expected packed [E, N/{TILE_ROWS}, K/{TILE_COLS}, {TILE_ROWS}, "
                             f"{TILE_COLS // 2}] and scales [..., {TILE_COLS // 32}], got packed {tuple(p.shape)} "
                             f"and scales {tuple(s.shape)}")
        logical = torch.Size((p.shape[0], p.shape[1] * TILE_ROWS, p.shape[2] * TILE_COLS))
        if self.shape is not None and torch.Size(self.shape) != logical:
            raise ValueError(f"TileMajorMXFP4: shape {tuple(self.shape)} does not match packed (logical "
                             f"{tuple(logical)})")
        self.shape = logical

    def checkpoint_layout(self, index: torch.Tensor | int | list[int] | slice | None = None) -> MXFP4Tensor:
        """The checkpoint layout (a copy): all experts, or `index` as `MXFP4Tensor.dequantize`
        takes it (an int: that expert, [N, K]; a list or 1-D tensor: those, [n, N, K]), or a
        slice of the experts ([n, N, K], no index upload)."""
        packed, scales = self.packed, self.scales
        if index is not None:
            if isinstance(index, list):
                index = torch.tensor(index, dtype=torch.long, device=packed.device)
            packed, scales = packed[index], scales[index]
        lead = packed.shape[:-4]
        n_tiles, k_tiles = packed.shape[-4], packed.shape[-3]
        untile = lambda t: t.movedim(-3, -2).reshape(*lead, n_tiles * TILE_ROWS, k_tiles * t.shape[-1])  # noqa: E731
        return MXFP4Tensor(untile(packed).contiguous(), untile(scales).contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   index: torch.Tensor | int | list[int] | None = None) -> torch.Tensor:
        """`MXFP4Tensor.dequantize` of the same weights (only the selected experts untiled)."""
        return self.checkpoint_layout(index).dequantize(dtype)

    def to(self, device) -> TileMajorMXFP4:
        return TileMajorMXFP4(self.packed.to(device), self.scales.to(device), self.shape)


def tileable(w: MXFP4Tensor) -> bool:
    """Whether w (a checkpoint-layout stack [E, N, K]) divides into whole tiles: N % 128 == 0 and
    K % 64 == 0."""
    return (not isinstance(w, TileMajorMXFP4) and w.packed.dim() == 3 and w.packed.shape[1] % TILE_ROWS == 0
            and (2 * w.packed.shape[2]) % TILE_COLS == 0)


def to_tile_major(w: MXFP4Tensor) -> TileMajorMXFP4:
    """w's codes and scales copied tile by tile (on w's device)."""
    if not tileable(w):
        raise ValueError(f"to_tile_major: a checkpoint-layout MXFP4 stack [E, N, K] with N % {TILE_ROWS} == 0 and "
                         f"K % {TILE_COLS} == 0, got codes {tuple(w.packed.shape)}")
    e, n, half_k = w.packed.shape
    tiles = (e, n // TILE_ROWS, TILE_ROWS, half_k * 2 // TILE_COLS)
    packed = w.packed.reshape(*tiles, TILE_COLS // 2).permute(0, 1, 3, 2, 4).contiguous()
    scales = w.scales.reshape(*tiles, TILE_COLS // 32).permute(0, 1, 3, 2, 4).contiguous()
    return TileMajorMXFP4(packed, scales)
