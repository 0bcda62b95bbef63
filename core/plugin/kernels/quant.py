"""Codec kernel entries for quantised cache pages and weights: `QuantKernels`. Each is bit-exact
with the `k3.quant` codec of the same name, which returns the same named tuples (the codecs sit
below the contract: checkpoint loading uses them too)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from k3.quant.fp8 import DEFAULT_AMAX_FLOOR, FP8Quantized
from k3.quant.mxfp4 import MXFP4Packed
from k3.quant.nvfp4 import NVFP4Packed


class FP8Quantize(Protocol):
    """`quant.fp8_quantize`: x `[..., D]` (any float dtype) to fp8 with fp32 scales.

    block_size None: one scale for the whole tensor (scale `[]`); an int: one per block of
    block_size consecutive elements along the last axis (scale `[..., D/block_size]`). scale: a
    given scale used as is (a static KV-cache scale; no host synchronisation then), else
    amax / fmax with amax floored at amax_floor. dtype: e4m3fn (fmax 448) or e4m3fnuz (240), the
    capability's flavour. q = clamp(x / scale, +-fmax) rounded to nearest even; the scale is
    rounded to fp32 before the division. Returns `FP8Quantized(values, scale)`.
    """

    def __call__(self, x: Tensor, *, block_size: int | None = None, scale: Tensor | float | None = None,
                 dtype: torch.dtype = torch.float8_e4m3fn, amax_floor: float = DEFAULT_AMAX_FLOOR) -> FP8Quantized: ...


class FP8Dequantize(Protocol):
    """`quant.fp8_dequantize`: q * scale, the inverse of `fp8_quantize`: q fp8 `[..., D]`, scale
    fp32 `[]` (or a float) or `[..., D/block_size]`; multiplied in fp32 (fp64 for float64),
    returns `dtype`."""

    def __call__(self, q: Tensor, scale: Tensor | float, *, block_size: int | None = None,
                 dtype: torch.dtype = torch.float32) -> Tensor: ...


class MXFP4Quantize(Protocol):
    """`quant.mxfp4_quantize`: x `[..., N]` (N % 32 == 0) to MXFP4, OCP rule per 32 elements:
    shared exponent floor(log2 amax) - 2 (clamped to E8M0's range), codes rounded half to even
    onto E2M1, saturating at +-6. Returns `MXFP4Packed(packed uint8 [..., N/2] (element 2i in
    the low nibble), scales uint8 E8M0 [..., N/32])`."""

    def __call__(self, x: Tensor) -> MXFP4Packed: ...


class MXFP4Dequantize(Protocol):
    """`quant.mxfp4_dequantize`: packed `[..., N/2]`, scales `[..., N/32]` -> `[..., N]` in dtype,
    x = E2M1(code) * 2^(scale - 127) (scale byte 255 gives NaN)."""

    def __call__(self, packed: Tensor, scales: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor: ...


class NVFP4Quantize(Protocol):
    """`quant.nvfp4_quantize`: x `[..., N]` (N % 16 == 0) to NVFP4: global_scale (default
    amax / (6 * 448), ModelOpt's convention; compressed-tensors stores the reciprocal), per 16
    elements an e4m3fn block scale block_amax / (6 * global), codes onto E2M1. Returns
    `NVFP4Packed(packed uint8 [..., N/2], block_scales e4m3fn [..., N/16], global_scale fp32 0-d)`."""

    def __call__(self, x: Tensor, *, global_scale: Tensor | float | None = None) -> NVFP4Packed: ...


class NVFP4Dequantize(Protocol):
    """`quant.nvfp4_dequantize`: x = E2M1(code) * block_scale * global_scale -> `[..., N]` in dtype."""

    def __call__(self, packed: Tensor, block_scales: Tensor, global_scale: Tensor | float, *,
                 dtype: torch.dtype = torch.float32) -> Tensor: ...
