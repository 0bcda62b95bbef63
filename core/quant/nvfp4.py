"""NVFP4 (ModelOpt convention): E2M1 codes in blocks of 16, FP8 E4M3 block scales, fp32 global.

    x = E2M1(code) * float(s_e4m3[block]) * global_scale,   global_scale = amax / (6 * 448)

This is ModelOpt's `weight_scale_2` convention (`nvidia/Kimi-K3-NVFP4`). compressed-tensors
stores the reciprocal, `weight_global_scale = (6 * 448) / amax`, and decodes with
`x = code * s_e4m3 / weight_global_scale`: pass `1 / weight_global_scale` here.
Packing is the shared FP4 one: element 2i in the low nibble.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fp4 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

NVFP4_BLOCK = 16
E4M3_MAX = 448.0


class NVFP4Packed(NamedTuple):
    """What `nvfp4_quantize` returns: packed uint8 `[..., N/2]`, block_scales float8_e4m3fn
    `[..., N/16]`, global_scale fp32 0-d."""

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor


def nvfp4_quantize(
    x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None
) -> NVFP4Packed:
    """Quantise x [..., N] (N % 16 == 0, any float dtype) to NVFP4.

    Returns NVFP4Packed(packed uint8 [..., N/2], block_scales float8_e4m3fn [..., N/16],
    global_scale fp32 0-d). global_scale defaults to amax(|x|) / (6 * 448) over the whole
    tensor (1.0 for an all-zero tensor); a given tensor scale must be positive (not checked:
    no host synchronisation). Per block: s = block_amax / (6 * global_scale),
    clamped to 448 and rounded to E4M3; codes = round-half-to-even(x / (s * global_scale))
    onto the E2M1 grid, saturating at +-6. A block whose E4M3 scale is 0 (all zeros, or
    below E4M3's smallest subnormal relative to the global scale) gets zero codes.
    Computed in fp32 (float64 input in float64).
    """
    if not x.is_floating_point():
        raise ValueError(f"nvfp4_quantize: x must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_quantize: x must be [..., N] with N % 16 == 0, got {tuple(x.shape)}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[-1]
    xb = x.to(cd).reshape(*x.shape[:-1], n // NVFP4_BLOCK, NVFP4_BLOCK)  # [..., N/16, 16]
    if global_scale is None:
        # a 0-d reduction over the flattened tensor: torch-xla 2.9's amax() without dim keeps
        # the input's shape, so this form serves XLA too
        amax = x.abs().reshape(-1).amax(0).to(torch.float32)
        gs = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    else:
        # a number is checked here; a tensor only for its size (its value would need a host
        # synchronisation: the cache's stores run inside captured decode graphs)
        if not isinstance(global_scale, torch.Tensor) and not global_scale > 0:
            raise ValueError(f"nvfp4_quantize: global_scale must be one positive value, got {global_scale}")
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if gs.numel() != 1:
            raise ValueError(f"nvfp4_quantize: global_scale must be one positive value, got {global_scale}")
        gs = gs.reshape(())
    block_amax = xb.abs().amax(dim=-1)  # [..., N/16]
    s = (block_amax / (E2M1_MAX * gs.to(cd))).clamp(max=E4M3_MAX)
    block_scales = s.to(torch.float8_e4m3fn)  # [..., N/16]
    denom = block_scales.to(cd) * gs.to(cd)  # [..., N/16] effective per-block multiplier
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where((denom > 0).unsqueeze(-1), xb / safe.unsqueeze(-1), torch.zeros_like(xb))
    codes = e2m1_encode(scaled).reshape(x.shape)  # uint8 [..., N]
    return NVFP4Packed(pack_nibbles(codes), block_scales, gs)


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 -> dense: packed uint8 [..., N/2], block_scales float8_e4m3fn [..., N/16],
    global_scale fp32 (one value, ModelOpt convention) -> `dtype` [..., N].

    x = E2M1(code) * float(block_scale) * global_scale, computed in fp32 (float64 when dtype
    is float64), then cast to `dtype`.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"nvfp4_dequantize: packed must be uint8, got {packed.dtype}")
    if block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"nvfp4_dequantize: block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    if packed.dim() == 0 or packed.shape[-1] % (NVFP4_BLOCK // 2) \
            or block_scales.shape != (*packed.shape[:-1], packed.shape[-1] * 2 // NVFP4_BLOCK):
        raise ValueError(
            "nvfp4_dequantize: expected packed [..., N/2] and block_scales [..., N/16] with N % 16 == 0, "
            f"got packed {tuple(packed.shape)} and block_scales {tuple(block_scales.shape)}"
        )
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    if gs.numel() != 1:
        raise ValueError(f"nvfp4_dequantize: global_scale must be one value, got shape {tuple(gs.shape)}")
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(unpack_nibbles(packed), dtype=cd)  # [..., N]
    vals = vals.reshape(*block_scales.shape, NVFP4_BLOCK)  # [..., N/16, 16]
    mult = block_scales.to(cd) * gs.to(cd).reshape(())  # [..., N/16]
    return (vals * mult.unsqueeze(-1)).reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)
