"""FP4 E2M1 elements, shared by MXFP4 and NVFP4: code table, rounding, nibble packing.

An E2M1 code is 4 bits: sign (bit 3), 2 exponent bits (bias 1), 1 mantissa bit; no inf/NaN.
Codes 0..7 are `0, 0.5, 1, 1.5, 2, 3, 4, 6` and codes 8..15 are the same values negated
(code 8 is -0). Two codes share a byte: element 2i in the LOW nibble, element 2i+1 in the high
nibble (compressed-tensors `pack_fp4_to_uint8`, gpt-oss, HF transformers).
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0

# Code -> value, as Python floats (tensors are built per call, in the caller's dtype/device).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# Midpoints between neighbouring magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, and whether a value
# exactly on the midpoint rounds up. Round-half-to-even: a tie goes to the neighbour whose
# code is even (mantissa bit 0), i.e. up after an odd code, down after an even one.
_MIDPOINTS = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)  # fmt: skip


_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def e2m1_table(*, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16-entry code -> value table as a [16] tensor of `dtype`, built once per (dtype,
    device): a table built from host data on every call breaks CUDA-graph capture."""
    key = (dtype, str(torch.device(device) if device is not None else torch.device("cpu")))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return _TABLES[key]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values onto the E2M1 grid: uint8 codes 0..15, same shape as x.

    Round-half-to-even on the grid, saturating at +-6 (inf saturates too). The sign bit follows
    the input's sign bit, so -0.0 and small negatives that round to zero give code 8 (-0).
    Comparisons are exact in x's own dtype (every midpoint is exactly representable in
    bf16/fp16/fp32/fp64). NaN input is not supported (it encodes as a signed zero).
    The sign bit is read without `torch.signbit` (`negative_bit`), which torch-xla 2.9 runs on
    the CPU, so the XLA platforms serve this codec as is.
    """
    if not x.is_floating_point():
        raise ValueError(f"e2m1_encode: x must be a floating tensor, got {x.dtype}")
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | (negative_bit(x).to(torch.uint8) << 3)


def negative_bit(x: torch.Tensor) -> torch.Tensor:
    """bool: x's sign bit for non-NaN x (True for negatives and -0.0), as `torch.signbit`
    without it: -0.0 is told from +0.0 by its reciprocal (-inf)."""
    return (x < 0) | ((x == 0) & (torch.reciprocal(x) < 0))


def e2m1_decode(codes: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes 0..15 (any shape) -> values of `dtype`, same shape (exact in every float dtype)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"e2m1_decode: codes must be uint8, got {codes.dtype}")
    return e2m1_table(dtype=dtype, device=codes.device)[(codes & 0x0F).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N] (N even, values 0..15) -> packed uint8 [..., N/2].

    Byte i = codes[2i] | codes[2i+1] << 4 (element 2i in the low nibble).
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_nibbles: codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: codes must be [..., N] with N even, got {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # [..., N/2, 2]
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., M] -> uint8 codes [..., 2M] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles: packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_nibbles: packed must be [..., M], got a 0-d tensor")
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., M, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
