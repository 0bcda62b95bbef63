"""The MXFP4 quantiser for XLA (weights, index keys) without `torch.frexp`, which torch-xla 2.9
runs on the CPU; bit-exact with `k3.quant.mxfp4.mxfp4_quantize` (the oracle,
`k3.reference.mxfp4_quantize` / `indexer_quantize_keys`).

MXFP4's shared exponent floor(log2(amax)) - 2 is `floor(log2(amax))` corrected by one either way
against exact powers of two (`pow(2, e)` of an integer e is exact), instead of `frexp`; amax = 0
gives frexp's exponent (floor = -1), and anything below 2^-124 lands on E8M0's floor (-127)
either way. Everything else of `k3.quant` is XLA-clean as it is and served as is: the E2M1
encoder reads the sign without `torch.signbit`, and the fp8 and NVFP4 quantisers take their
whole-tensor max as `reshape(-1).amax(0)` (torch-xla 2.9's `amax()` without `dim` keeps the
input's shape).
"""

from __future__ import annotations

import torch

from k3.plugin.kernels import QuantizedKeys
from k3.quant.fp4 import e2m1_encode, pack_nibbles
from k3.quant.fp8 import fp8_quantize
from k3.quant.mxfp4 import E8M0_BIAS, MXFP4_BLOCK, MXFP4Packed

_E2M1_EMAX = 2


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
