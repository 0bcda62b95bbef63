"""A tile-major copy of MXFP4 expert weights, the layout the decode_bf16 tiles stream (issue 27).

The checkpoint layout (`MXFP4Tensor`: codes [E, N, K/2], scales [E, N, K/32]) keeps each weight
row contiguous. A tile program of the MoE kernels owns 128 rows and steps along them 64 columns
at a time, so a step reads 32 code bytes and 2 scale bytes from each of 128 rows 1,792 bytes
apart (k3-slice): on an H100 that access pattern streams the codes at 62% of the copy bandwidth
and, with the scale bytes (a 32-byte sector fetched for 2 bytes), at 47%
(bench/moe_weight_stream.py). Laid out tile by tile, a step's 128 x 32 code bytes are one
contiguous 4 KB block and its scales one 256-byte block: 98% of the copy bandwidth.

    codes  [E, N/128, K/64, 128, 32] uint8   tile (n, k): rows 128n.., columns 64k..
    scales [E, N/128, K/64, 128, 2]  uint8

The copy is built once, at load time (the nvidia plugin's `k3_process_weights`, when the
experimental `moe_experts_bf16` entry serves), and remembered on the codes tensor with both
tensors' version counters; `tiles_of` returns it only while neither tensor was written since,
and never builds one (it is called during CUDA-graph capture). The checkpoint layout stays:
every other kernel reads it, so the copy costs the experts' bytes a second time (k3-slice:
17.7 GB), until the other MoE kernels read tiles too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3.quant.mxfp4 import MXFP4Tensor

TILE_ROWS = 128         # weight rows a tile (the tiles' BLOCK_N, or a multiple of it)
TILE_COLS = 64          # columns a tile: 32 code bytes and 2 scale bytes a row
_ATTR = "_k3_tiles"     # on the codes tensor: ((codes version, scales version), TiledMXFP4)


class TiledMXFP4(NamedTuple):
    """An MXFP4 expert stack laid out tile by tile (module docstring)."""

    packed: torch.Tensor        # [E, N/128, K/64, 128, 32] uint8
    scales: torch.Tensor        # [E, N/128, K/64, 128, 2] uint8


def tileable(w: MXFP4Tensor) -> bool:
    """Whether w (a stack [E, N, K]) divides into whole tiles: N % 128 == 0 and K % 64 == 0."""
    return w.packed.dim() == 3 and w.packed.shape[1] % TILE_ROWS == 0 and (2 * w.packed.shape[2]) % TILE_COLS == 0


def to_tiles(w: MXFP4Tensor) -> TiledMXFP4:
    """w's codes and scales copied tile by tile (one copy each, on w's device)."""
    if not tileable(w):
        raise ValueError(f"to_tiles: an MXFP4 stack [E, N, K] with N % {TILE_ROWS} == 0 and K % {TILE_COLS} == 0, "
                         f"got codes {tuple(w.packed.shape)}")
    e, n, half_k = w.packed.shape
    tiles = (e, n // TILE_ROWS, TILE_ROWS, half_k * 2 // TILE_COLS)
    packed = w.packed.reshape(*tiles, TILE_COLS // 2).permute(0, 1, 3, 2, 4).contiguous()
    scales = w.scales.reshape(*tiles, TILE_COLS // 32).permute(0, 1, 3, 2, 4).contiguous()
    return TiledMXFP4(packed, scales)


def from_tiles(t: TiledMXFP4) -> MXFP4Tensor:
    """The checkpoint layout back (the inverse of `to_tiles`)."""
    e, n_tiles, k_tiles, rows, half = t.packed.shape
    packed = t.packed.permute(0, 1, 3, 2, 4).reshape(e, n_tiles * rows, k_tiles * half)
    scales = t.scales.permute(0, 1, 3, 2, 4).reshape(e, n_tiles * rows, k_tiles * t.scales.shape[-1])
    return MXFP4Tensor(packed.contiguous(), scales.contiguous())


def _versions(w: MXFP4Tensor) -> tuple[int, int]:
    return w.packed._version, w.scales._version


def attach_tiles(w: MXFP4Tensor) -> int:
    """Build w's tiled copy and remember it on w's codes tensor (replacing an older one).
    Returns the bytes it holds (0: w does not divide into tiles, nothing attached)."""
    if not tileable(w):
        return 0
    tiles = to_tiles(w)
    setattr(w.packed, _ATTR, (_versions(w), tiles))
    return tiles.packed.numel() + tiles.scales.numel()


def tiles_of(w) -> TiledMXFP4 | None:
    """w's tiled copy if w is an MXFP4 stack, one was attached and neither of w's tensors was
    written since; else None (dense experts: None). Never builds one (safe during graph capture)."""
    if not isinstance(w, MXFP4Tensor):
        return None
    versions, tiles = getattr(w.packed, _ATTR, (None, None))
    return tiles if versions == _versions(w) else None
