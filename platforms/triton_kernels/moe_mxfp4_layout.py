"""The tile-major MXFP4 expert layout (`k3.quant.mxfp4_tiles`) as the MoE kernels take it (issue 27).

A tile program of the MoE kernels owns 128 weight rows and steps along them 64 columns at a
time. On the checkpoint layout a step reads 32 code bytes and 2 scale bytes from each of 128
rows 1,792 bytes apart (k3-slice): on an H100 that pattern streams the codes at 62% of the copy
bandwidth, 47% with the scale bytes (bench/moe_weight_stream.py). Tile by tile, a step's codes
are one contiguous 4 KB block and its scales one 256-byte block: 98%.

Every reader of MXFP4 experts here takes `TileMajorMXFP4` experts in place of the checkpoint
layout (`moe_mxfp4.experts_forward`: the tensor-core tiles, the gemv, the prefill dequant mode;
the experimental grouped gemv excepted) and gets the same result bit for bit. The nvidia
plugin's `k3_process_weights` repacks a model's experts into it in place when the experimental
`moe_experts_bf16` entry serves (`k3.model.ffn.MoE.hold_experts_tile_major`).
"""

from __future__ import annotations

from k3.quant.mxfp4 import MXFP4Tensor
from k3.quant.mxfp4_tiles import TILE_COLS, TILE_ROWS, TileMajorMXFP4

__all__ = ["TILE_COLS", "TILE_ROWS", "TileMajorMXFP4", "tile_pair", "tiles_of"]


def tiles_of(w) -> TileMajorMXFP4 | None:
    """w itself if it is a tile-major MXFP4 stack, else None (the checkpoint layout, dense
    experts)."""
    return w if isinstance(w, TileMajorMXFP4) else None


def tile_pair(w13: MXFP4Tensor, w2: MXFP4Tensor):
    """(w13, w2) when both are tile-major, None when neither is; a mix is an error (a model
    repacks its experts together)."""
    tiles = tiles_of(w13), tiles_of(w2)
    if None in tiles and tiles != (None, None):
        raise ValueError("moe_mxfp4: w13 and w2 must both be tile-major or both in the checkpoint layout")
    return None if tiles == (None, None) else tiles
