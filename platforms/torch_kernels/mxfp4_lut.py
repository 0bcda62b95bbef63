"""MXFP4 -> dense in eager torch through one lookup a packed byte, the scale folded into the
table: what the torch-native experts (`moe_w4a16`) dequantise with when the routed experts are
not held dense.

The table has 65,536 entries, one per (E8M0 scale byte s, packed code byte b): the two values
(E2M1(b & 15), E2M1(b >> 4)) * 2^(s - 127), computed exactly in float64 and rounded once to the
target dtype (what `k3.quant.mxfp4.mxfp4_dequantize` gives: exact in bf16 / fp32 within their
range, inf past it, NaN for s = 255). For a 2- or 4-byte dtype an entry is one integer word
(int32 / int64) holding both values, the first in the low half (little-endian), so a gather of
words writes the dense row directly. Two passes over each weight:

    idx = packed (uint8, viewed [.., C/32, 16]) + 256 * scale (int32 [.., C/32, 1])   0.5 B in, 2 B out
    out.view(word) = table[idx]                                                         2 B in, 2 B out

6.5 bytes a weight (bf16 out) in two kernels, against ~11.5 in five for the nibble table plus a
scale multiply it replaces; int32 indices only. Where the device compiles (torch.compile),
`lookup_into` fuses both passes into one kernel: 2.5 bytes a weight. The table (256 KiB in bf16) is built on a
device's first call, before any graph capture (the decode-graph warm-up calls run first).
"""

from __future__ import annotations

import sys

import torch

from k3.quant.mxfp4 import MXFP4_BLOCK, MXFP4Tensor
from k3.quant.mxfp4_tiles import TileMajorMXFP4

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_WORD = {2: torch.int32, 4: torch.int64}        # two values of this itemsize in one integer word
_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def scaled_byte_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[65536] words (2- and 4-byte dtypes) or [65536, 2] values (float64): entry s * 256 + b
    holds the two values byte b codes under scale byte s (module docstring). Cached per (dtype,
    device)."""
    key = (dtype, str(torch.device(device)))
    if key not in _TABLES:
        if sys.byteorder != "little":
            raise RuntimeError("mxfp4_lut: the word table assumes a little-endian host")
        codes = torch.arange(256)
        e2m1 = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)
        pair = torch.stack([e2m1[codes & 15], e2m1[codes >> 4]], -1)                       # [256 b, 2]
        scale = torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")], dtype=torch.float64)
        values = (scale[:, None, None] * pair[None]).reshape(65536, 2).to(dtype)           # [s * 256 + b, 2]
        word = _WORD.get(dtype.itemsize)
        table = values.view(word).reshape(65536) if word is not None else values
        _TABLES[key] = table.to(device)
    return _TABLES[key]


def lookup_into(out: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
                index: torch.Tensor | None = None) -> torch.Tensor:
    """The two passes of the module docstring as one function of tensors, for torch.compile to
    fuse into one kernel (0.5 B read and 2 B written a bf16 weight, the int32 indices never
    stored): out [n, R, C] (contiguous) = the experts `index` of packed [E, R, C/2] / scales
    [E, R, C/32] (all of them when index is None) through `table` (`scaled_byte_table` of out's
    dtype). Eager, it runs the same two passes as `lut_dequantize`. Returns `out`."""
    if index is not None:
        packed, scales = packed.index_select(0, index), scales.index_select(0, index)
    n, rows, blocks = scales.shape
    idx = packed.reshape(n, rows, blocks, MXFP4_BLOCK // 2).to(torch.int32) \
        + scales.to(torch.int32).mul(256).view(n, rows, blocks, 1)                       # [n, R, C/32, 16]
    if table.dim() == 1:
        out.view(table.dtype).view(idx.shape).copy_(table[idx])
    else:
        out.view(*idx.shape, 2).copy_(table[idx])
    return out


def lut_dequantize(w: MXFP4Tensor, out: torch.Tensor, *, start: int = 0,
                   index: torch.Tensor | None = None, fused=None) -> torch.Tensor:
    """Experts of the stacked MXFP4 `w` ([E, R, C] logical) written densely into `out`
    ([n, R, C], contiguous, any float dtype): w[start:start + n], or w[index] (a device index
    tensor of n experts: no host read). fused: `lookup_into` compiled (one kernel, where the
    device compiles: `moe_w4a16.build_experts`), or None for the two eager passes. Returns `out`."""
    n, rows, cols = out.shape
    if not out.is_contiguous() or tuple(w.shape[1:]) != (rows, cols):
        raise ValueError(f"lut_dequantize: out must be contiguous [n, {w.shape[1]}, {w.shape[2]}], "
                         f"got {tuple(out.shape)}")
    if isinstance(w, TileMajorMXFP4):   # a platform's tile-major repack: the selected experts untiled (a copy)
        w = w.checkpoint_layout(index if index is not None else slice(start, start + n))
        start, index = 0, None
    table = scaled_byte_table(out.dtype, out.device)
    if index is None:
        packed, scales = w.packed[start:start + n], w.scales[start:start + n]             # views: no copy
    elif fused is None:
        packed, scales = w.packed.index_select(0, index), w.scales.index_select(0, index)
    else:
        packed, scales = w.packed, w.scales                                               # the fused gather selects
    if fused is not None:
        return fused(out, packed, scales, table, index)
    blocks = cols // MXFP4_BLOCK
    shift = scales.to(torch.int32).mul_(256).view(n, rows, blocks, 1)                      # [n, R, C/32, 1]
    idx = torch.add(packed.reshape(n, rows, blocks, MXFP4_BLOCK // 2), shift)             # int32 [n, R, C/32, 16]
    if table.dim() == 1:
        torch.index_select(table, 0, idx.view(-1), out=out.view(table.dtype).view(-1))
    else:
        torch.index_select(table, 0, idx.view(-1), out=out.view(-1, 2))
    return out
