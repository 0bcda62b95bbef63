"""Quantisers for XLA: MXFP4 and NVFP4 (weights, index keys) without the two ops torch-xla 2.9
runs on the CPU, `torch.frexp` and `torch.signbit`; bit-exact with `k3.quant`'s codecs (the
oracles, `k3.reference.mxfp4_quantize` / `nvfp4_quantize` / `indexer_quantize_keys`).

- The E2M1 sign bit: `x < 0`, or `x == 0` with `1 / x < 0` (-0.0), instead of `signbit`.
- MXFP4's shared exponent floor(log2(amax)) - 2: `floor(log2(amax))` corrected by one either
  way against exact powers of two (`pow(2, e)` of an integer e is exact), instead of `frexp`;
  amax = 0 gives frexp's exponent (floor = -1), and anything below 2^-124 lands on E8M0's
  floor (-127) either way.
- A whole-tensor amax as `reshape(-1).amax(0)`: torch-xla 2.9's `amax()` without `dim` returns a
  tensor of the input's shape (not 0-d), which broke the per-tensor fp8 scale and the NVFP4
  global scale (`k3.quant.fp8_quantize` takes its whole-tensor max this way itself, so it is
  served as is).
The dequantisers of `k3.quant` are XLA-clean as they are (served as is).
"""

from __future__ import annotations

import torch

from k3.plugin.kernels import QuantizedKeys
from k3.quant.fp4 import E2M1_MAX, pack_nibbles
from k3.quant.fp8 import fp8_quantize
from k3.quant.mxfp4 import E8M0_BIAS, MXFP4_BLOCK, MXFP4Packed
from k3.quant.nvfp4 import E4M3_MAX, NVFP4_BLOCK, NVFP4Packed

_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E2M1_EMAX = 2


def whole_amax(x: torch.Tensor) -> torch.Tensor:
    """0-d max |x| over every element (see the module docstring for why not `amax()`)."""
    return x.abs().reshape(-1).amax(0)


def negative_bit(x: torch.Tensor) -> torch.Tensor:
    """bool: x's sign bit (True for -0.0 and negatives), without `torch.signbit`."""
    return (x < 0) | ((x == 0) & (torch.reciprocal(x) < 0))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """`k3.quant.fp4.e2m1_encode` (uint8 codes, round-half-to-even, saturating) with the sign
    from `negative_bit`."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        code = code + (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | (negative_bit(x).to(torch.uint8) << 3)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """int32 floor(log2(a)) for a >= 0 (exact; -1 for a = 0, as frexp's exponent - 1; values below
    2^-124 may come out anywhere at or below -124)."""
    pos = a > 0
    safe = torch.where(pos, a, torch.ones_like(a))
    e = torch.floor(torch.log2(safe)).clamp(-160, 160)
    e = torch.where(torch.pow(2.0, e) > safe, e - 1, e)                     # log2 rounded up across a power
    e = torch.where(torch.pow(2.0, e + 1) <= safe, e + 1, e)                # or down below one
    return torch.where(pos, e, torch.full_like(e, -1)).to(torch.int32)


def mxfp4_quantize(x: torch.Tensor) -> MXFP4Packed:
    """`k3.quant.mxfp4.mxfp4_quantize` (OCP shared exponent, E2M1 codes), XLA-clean."""
    if not x.is_floating_point():
        raise ValueError(f"mxfp4_quantize: x must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"mxfp4_quantize: x must be [..., N] with N % 32 == 0, got {tuple(x.shape)}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xb = x.to(cd).reshape(*x.shape[:-1], x.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)     # [..., N/32, 32]
    shared = (floor_log2(xb.abs().amax(dim=-1)) - _E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)   # [..., N/32]
    scaled = xb * torch.pow(2.0, -shared.to(cd)).unsqueeze(-1)                          # exact
    codes = e2m1_encode(scaled).reshape(x.shape)
    return MXFP4Packed(pack_nibbles(codes), (shared + E8M0_BIAS).to(torch.uint8))


def nvfp4_quantize(x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None) -> NVFP4Packed:
    """`k3.quant.nvfp4.nvfp4_quantize` (E4M3 block scales, fp32 global scale), XLA-clean."""
    if not x.is_floating_point():
        raise ValueError(f"nvfp4_quantize: x must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_quantize: x must be [..., N] with N % 16 == 0, got {tuple(x.shape)}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xb = x.to(cd).reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)     # [..., N/16, 16]
    if global_scale is None:
        amax = whole_amax(x).to(torch.float32)
        gs = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    else:
        if not isinstance(global_scale, torch.Tensor) and not global_scale > 0:
            raise ValueError(f"nvfp4_quantize: global_scale must be one positive value, got {global_scale}")
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if gs.numel() != 1:
            raise ValueError(f"nvfp4_quantize: global_scale must be one positive value, got {global_scale}")
        gs = gs.reshape(())
    gsc = gs.to(cd)
    s = (xb.abs().amax(dim=-1) / (E2M1_MAX * gsc)).clamp(max=E4M3_MAX)
    block_scales = s.to(torch.float8_e4m3fn)                                            # [..., N/16]
    denom = block_scales.to(cd) * gsc
    live = denom > 0
    safe = torch.where(live, denom, torch.ones_like(denom))
    scaled = torch.where(live.unsqueeze(-1), xb / safe.unsqueeze(-1), torch.zeros_like(xb))
    codes = e2m1_encode(scaled).reshape(x.shape)
    return NVFP4Packed(pack_nibbles(codes), block_scales, gs)


def indexer_quantize_keys(k: torch.Tensor, *, fmt: str = "fp8") -> QuantizedKeys:
    """`IndexerQuantizeKeys`: fp8 with one scale per token (`k3.quant`'s codec as is) or MXFP4
    (this module's quantiser)."""
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"indexer_quantize_keys: fmt must be 'fp8' or 'mxfp4'; got {fmt!r}")
    if k.dim() != 2 or not k.is_floating_point():
        raise ValueError(f"indexer_quantize_keys: k must be a float tensor [S, D]; got {k.dtype} {tuple(k.shape)}")
    if fmt == "mxfp4":
        return QuantizedKeys(*mxfp4_quantize(k))
    values, scales = fp8_quantize(k, block_size=k.shape[1], dtype=torch.float8_e4m3fn)
    return QuantizedKeys(values, scales.reshape(-1))
