"""MXFP4 (OCP Microscaling v1.0): E2M1 codes in blocks of 32 sharing one E8M0 scale.

This is the compressed-tensors `mxfp4-pack-quantized` format of K3's routed experts: per
Linear `[out, in]`, `weight_packed` uint8 `[out, in/2]` (element 2i in the low nibble) and
`weight_scale` uint8 `[out, in/32]`, a raw E8M0 byte per 32 consecutive input columns whose
value is `2^(byte - 127)` (byte 255 is NaN). There is no global scale:
`W[o, i] = E2M1(code[o, i]) * 2^(scale[o, i // 32] - 127)`.

The compressed-tensors library (0.17) writes the same layout and rounds elements the same way
for a given scale, and `mxfp4_dequantize` reads its bytes exactly as its decompressor does; its
quantiser picks the shared exponent differently: it rounds the group's amax to a power of two
first (adding a quarter of the significand), so a group whose amax significand is >= 1.75 gets
an exponent one above this module's OCP floor(log2(amax)) - 2 (no clipping, coarser steps).
All-zero groups get scale byte 0 there (124 here) and -0.0 code 0 (8 here); both decode alike.
tests/oracles/test_compressed_tensors.py pins each of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .fp4 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

MXFP4_BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2  # exponent of E2M1's largest binade (4 and 6 are 1.x * 2^2)


_E8M0_TABLES: dict[tuple[torch.dtype, str], torch.Tensor] = {}


def _e8m0_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256] byte -> 2^(byte - 127) in `dtype`; byte 255 -> NaN. Built once per (dtype,
    device) (graph capture), from exact powers of two computed on the host."""
    key = (dtype, str(torch.device(device) if device is not None else torch.device("cpu")))
    if key not in _E8M0_TABLES:
        values = [2.0 ** (b - E8M0_BIAS) for b in range(255)] + [float("nan")]
        _E8M0_TABLES[key] = torch.tensor(values, dtype=torch.float64).to(dtype).to(device)
    return _E8M0_TABLES[key]


class MXFP4Packed(NamedTuple):
    """What `mxfp4_quantize` returns: packed uint8 `[..., N/2]` (element 2i in the low nibble),
    scales uint8 E8M0 `[..., N/32]`."""

    packed: torch.Tensor
    scales: torch.Tensor


def mxfp4_quantize(x: torch.Tensor) -> MXFP4Packed:
    """Quantise x [..., N] (N % 32 == 0, any float dtype) to MXFP4.

    Returns MXFP4Packed(packed uint8 [..., N/2], scales uint8 [..., N/32]).
    OCP rule per 32-element block: shared_exp = floor(log2(amax)) - 2, clamped to E8M0's
    [-127, 127] (an all-zero block gets a valid scale and all-zero codes); codes =
    round-half-to-even(x / 2^shared_exp) onto the E2M1 grid, saturating at +-6 (the OCP rule
    can clip the top of a block: values in [6, 8) * 2^shared_exp become 6 * 2^shared_exp).
    Computed in fp32 (float64 input in float64); the exponent comes from frexp, so it is exact.
    """
    if not x.is_floating_point():
        raise ValueError(f"mxfp4_quantize: x must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"mxfp4_quantize: x must be [..., N] with N % 32 == 0, got {tuple(x.shape)}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[-1]
    xb = x.to(cd).reshape(*x.shape[:-1], n // MXFP4_BLOCK, MXFP4_BLOCK)  # [..., N/32, 32]
    amax = xb.abs().amax(dim=-1)  # [..., N/32]
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)  =>  floor(log2(amax)) = e - 1
    shared_exp = (e - 1 - _E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)  # int32 [..., N/32]
    scaled = xb * torch.pow(2.0, -shared_exp.to(cd)).unsqueeze(-1)  # exact: power-of-two multiply
    codes = e2m1_encode(scaled).reshape(x.shape)  # uint8 [..., N]
    scales = (shared_exp + E8M0_BIAS).to(torch.uint8)
    return MXFP4Packed(pack_nibbles(codes), scales)


def mxfp4_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 -> dense: packed uint8 [..., N/2], scales uint8 [..., N/32] -> `dtype` [..., N].

    x = E2M1(code) * 2^(scale - 127), computed in fp32 (float64 when dtype is float64), then
    cast to `dtype` (exact in bf16/fp32 within their range). Scale byte 255 gives NaN.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4_dequantize: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}"
        )
    if packed.dim() == 0 or scales.shape != (*packed.shape[:-1], packed.shape[-1] * 2 // MXFP4_BLOCK) \
            or packed.shape[-1] % (MXFP4_BLOCK // 2):
        raise ValueError(
            "mxfp4_dequantize: expected packed [..., N/2] and scales [..., N/32] with N % 32 == 0, "
            f"got packed {tuple(packed.shape)} and scales {tuple(scales.shape)}"
        )
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(unpack_nibbles(packed), dtype=cd)  # [..., N]
    vals = vals.reshape(*scales.shape, MXFP4_BLOCK)  # [..., N/32, 32]
    mult = _e8m0_table(cd, packed.device)[scales.long()].unsqueeze(-1)  # [..., N/32, 1]
    return (vals * mult).reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


@dataclass(eq=False)
class MXFP4Tensor:
    """An MXFP4 weight: packed uint8 [..., N/2] and E8M0 scales uint8 [..., N/32].

    For stacked routed experts the logical shape is [E, out, in]: packed [E, out, in/2], scales
    [E, out, in/32]; `packed[e]` / `scales[e]` are exactly the checkpoint's
    `experts.e.wX.weight_packed` [out, in/2] / `weight_scale` [out, in/32].
    `shape` is the logical (dequantised) shape; None infers it from `packed`.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size | None = None

    def __post_init__(self) -> None:
        p, s = self.packed, self.scales
        if p.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise ValueError(f"MXFP4Tensor: packed and scales must be uint8, got {p.dtype} and {s.dtype}")
        if p.dim() == 0 or p.shape[-1] % (MXFP4_BLOCK // 2) \
                or s.shape != (*p.shape[:-1], p.shape[-1] * 2 // MXFP4_BLOCK):
            raise ValueError(
                "MXFP4Tensor: expected packed [..., N/2] and scales [..., N/32] with N % 32 == 0, "
                f"got packed {tuple(p.shape)} and scales {tuple(s.shape)}"
            )
        logical = torch.Size((*p.shape[:-1], p.shape[-1] * 2))
        if self.shape is not None and torch.Size(self.shape) != logical:
            raise ValueError(
                f"MXFP4Tensor: shape {tuple(self.shape)} does not match packed (logical {tuple(logical)})"
            )
        self.shape = logical

    @classmethod
    def from_float(cls, w: torch.Tensor) -> MXFP4Tensor:
        """Quantise a dense weight [..., N] (N % 32 == 0) with `mxfp4_quantize`."""
        packed, scales = mxfp4_quantize(w)
        return cls(packed, scales, w.shape)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, index: torch.Tensor | int | list[int] | None = None
    ) -> torch.Tensor:
        """Dense weight of `dtype` (computed in fp32, or float64 for float64).

        index: None -> the whole tensor [*shape]; an int -> row `index` of the leading
        (expert) axis [*shape[1:]]; a 1-D index tensor or list of n ids -> [n, *shape[1:]].
        Only the selected rows are dequantised.
        """
        if index is None:
            return mxfp4_dequantize(self.packed, self.scales, dtype=dtype)
        if self.packed.dim() < 2:
            raise ValueError(
                f"MXFP4Tensor.dequantize: index needs a leading (expert) axis, shape is {tuple(self.shape)}"
            )
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long, device=self.packed.device)
        return mxfp4_dequantize(self.packed[index], self.scales[index], dtype=dtype)

    def to(self, device) -> MXFP4Tensor:
        """The same tensor with packed and scales on `device`."""
        return MXFP4Tensor(self.packed.to(device), self.scales.to(device), self.shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dim(self) -> int:
        return len(self.shape)
