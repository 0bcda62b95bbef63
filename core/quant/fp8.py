"""FP8 codec (e4m3fn, e4m3fnuz, any torch float8 dtype) with per-tensor or per-block fp32 scales.

scale = amax / fmax (fmax = 448 for e4m3fn, 240 for e4m3fnuz: `torch.finfo(dtype).max`);
q = clamp(x / scale, +-fmax) cast to fp8 (round to nearest even); x ~= q * scale.
The scale is rounded to fp32 BEFORE the division, so dequantising with the stored scale is the
exact inverse of the division up to the fp8 rounding. Used for the MLA latent cache (one static
per-tensor scale) and the DSA index keys (one scale per token, `block_size = head_dim`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dtypes import compute_dtype

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

# vLLM's per-token-group quantiser floors amax at 1e-10; DeepSeek-V3.2's act_quant uses 1e-4.
DEFAULT_AMAX_FLOOR = 1e-10


class FP8Quantized(NamedTuple):
    """What `fp8_quantize` returns: values of the fp8 dtype `[..., D]`, scale fp32 `[]` or
    `[..., D/block_size]`."""

    values: torch.Tensor
    scale: torch.Tensor


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8: dtype must be one of {FP8_DTYPES}, got {dtype}")
    return float(torch.finfo(dtype).max)


def _blocks(x: torch.Tensor, block_size: int, op: str) -> torch.Tensor:
    """x [..., D] viewed as [..., D / block_size, block_size]."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: block_size must be a positive int or None, got {block_size!r}")
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(
            f"{op}: x must be [..., D] with D a multiple of block_size={block_size}; "
            f"got {tuple(x.shape)}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def fp8_quantize(
    x: torch.Tensor,
    *,
    block_size: int | None = None,
    scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    amax_floor: float = DEFAULT_AMAX_FLOOR,
) -> FP8Quantized:
    """Quantise x to fp8 with fp32 scales.

    x: float tensor [..., D] (any float dtype).
    block_size: None = one scale for the whole tensor (scale shape []); an int = one scale per
        block of `block_size` consecutive elements along the last axis (scale [..., D/block_size];
        128 for index keys of width 128 = one per token).
    scale: a given scale (e.g. a static per-tensor KV-cache scale) used as is: a float or a
        tensor broadcastable to the scale shape above. None = amax / fmax, amax floored at
        `amax_floor` so all-zero blocks do not divide by zero.
    dtype: the fp8 dtype (fmax = torch.finfo(dtype).max).
    Returns FP8Quantized(q [..., D] of `dtype`, scale fp32). The division runs in fp32 (fp64 for float64 x).
    """
    fmax = fp8_max(dtype)
    if not x.is_floating_point():
        raise ValueError(f"fp8_quantize: x must be a floating tensor, got {x.dtype}")
    cd = compute_dtype(x)
    xb = x.to(cd) if block_size is None else _blocks(x.to(cd), block_size, "fp8_quantize")
    scale_shape = () if block_size is None else xb.shape[:-1]
    if scale is None:
        # the whole-tensor max as a 0-d reduction over the flattened tensor: torch-xla 2.9's
        # amax() without dim keeps the input's shape, so this form serves XLA too
        amax = xb.abs().reshape(-1).amax(0) if block_size is None else xb.abs().amax(-1)  # scale_shape
        s = (amax.clamp_min(amax_floor) / fmax).to(torch.float32)
    else:
        given = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        try:
            s = torch.broadcast_to(given, scale_shape).clone()
        except RuntimeError:
            raise ValueError(
                f"fp8_quantize: scale must broadcast to {tuple(scale_shape)} "
                f"(block_size={block_size}); got {tuple(given.shape)}"
            ) from None
    sb = s.to(cd) if block_size is None else s.to(cd).unsqueeze(-1)
    q = (xb / sb).clamp(-fmax, fmax).to(dtype).reshape(x.shape)
    return FP8Quantized(q, s)


def fp8_dequantize(
    q: torch.Tensor,
    scale: torch.Tensor | float,
    *,
    block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q * scale, the inverse of `fp8_quantize`.

    q: fp8 tensor [..., D]; scale: fp32, shape [] (block_size None; a float also works) or
    [..., D/block_size]. Multiplies in fp32 (fp64 when dtype is float64), returns `dtype`.
    """
    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dequantize: q must be an fp8 tensor, got {q.dtype}")
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.as_tensor(scale, device=q.device).to(cd)
    if block_size is None:
        if s.numel() != 1:
            raise ValueError(
                f"fp8_dequantize: per-tensor scale must have one element; got {tuple(s.shape)}"
            )
        return (q.to(cd) * s.reshape(())).to(dtype)
    qb = _blocks(q, block_size, "fp8_dequantize")  # [..., nb, block]
    if tuple(s.shape) != tuple(qb.shape[:-1]):
        raise ValueError(
            f"fp8_dequantize: scale must be {tuple(qb.shape[:-1])} for q {tuple(q.shape)} "
            f"and block_size={block_size}; got {tuple(s.shape)}"
        )
    return (qb.to(cd) * s.unsqueeze(-1)).reshape(q.shape).to(dtype)
