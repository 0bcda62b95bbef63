"""Codecs (`QuantKernels`): FP8, MXFP4, NVFP4 quantise / dequantise.

Each codec is checked twice. On representable values (inputs built from codes and power-of-two
or exactly representable scales, with each block's maximum pinned so the scale rule lands on
them) the bytes, codes and scales must be exact. On random values, the decoded results must
agree within a codec-level tolerance (a correct kernel may round a value on a rounding boundary
the other way; systematic rounding errors do not fit).
"""

from __future__ import annotations

import torch

from k3 import reference as ref

from ..inputs import Inputs, randn
from ..registry import Case, Sample, Tolerance, register

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
# decoded values of a random-input quantisation: rounding flips only (any input dtype)
CODEC_TOL = {d: Tolerance(2e-2, 0.0) for d in ("float32", "bfloat16", "float64")}


def fp8_codes(g: torch.Generator, shape, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """float64 values exactly representable in `dtype`, log-uniform magnitudes, random signs."""
    mag = torch.exp2(torch.rand(tuple(shape), generator=g, dtype=torch.float64) * 14 - 6)
    sign = torch.randint(0, 2, tuple(shape), generator=g).double() * 2 - 1
    return (mag * sign).clamp(-448, 448).to(dtype).double()


def pin_block_max(g: torch.Generator, x: torch.Tensor, block: int, value: float) -> torch.Tensor:
    """Set one random element of every `block` along the last axis to +-value (the block max)."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block).clone()
    idx = torch.randint(0, block, xb.shape[:-1], generator=g)
    sign = torch.randint(0, 2, xb.shape[:-1], generator=g).double() * 2 - 1
    xb.scatter_(-1, idx.unsqueeze(-1), (value * sign).unsqueeze(-1))
    return xb.reshape(x.shape)


def block_pow2(g: torch.Generator, x: torch.Tensor, block: int, lo: int, hi: int) -> torch.Tensor:
    """x times 2^e, e random in [lo, hi] per block along the last axis."""
    e = torch.randint(lo, hi + 1, (*x.shape[:-1], x.shape[-1] // block, 1), generator=g).double()
    return (x.reshape(*x.shape[:-1], -1, block) * torch.exp2(e)).reshape(x.shape)


def e2m1_values(g: torch.Generator, shape) -> torch.Tensor:
    codes = E2M1[torch.randint(0, 8, tuple(shape), generator=g)]
    return codes * (torch.randint(0, 2, tuple(shape), generator=g).double() * 2 - 1)


def representable_mxfp4(g: torch.Generator, shape, lo=-8, hi=4) -> torch.Tensor:
    """float64 values on the MXFP4 grid whose OCP scale rule gives back their own exponents."""
    x = pin_block_max(g, e2m1_values(g, shape), 32, 6.0 if torch.rand((), generator=g) < 0.5 else 4.0)
    return block_pow2(g, x, 32, lo, hi)


def _fp8_decoded(q, scale, block):
    return ref.fp8_dequantize(q, scale, block_size=block, dtype=torch.float64)


# ------------------------------------------------------------------------------------ fp8

def _fp8_quantize(shape, *, block=None, representable=True, static_scale=None):
    def make(g, dtype):
        if representable:
            x = pin_block_max(g, fp8_codes(g, shape), block or shape[-1], 448.0)
            if block is None:
                x = x.flatten()
                x[torch.randint(0, x.numel(), (1,), generator=g)] = 448.0
                x = x.reshape(shape) * 2.0 ** -5
            else:
                x = block_pow2(g, x, block, -8, 2)
            x = x.to(dtype)
        else:
            x = randn(g, shape, dtype, 3.0)
        kw = {"block_size": block, "dtype": torch.float8_e4m3fn}
        if static_scale is not None:
            kw["scale"] = torch.tensor(static_scale, dtype=torch.float32)
        return Inputs((x,), kw)
    return make


def _fp8_quantize_outputs(result, args, kwargs):
    q, scale = result.values, result.scale
    return {"q": q, "scale": scale, "decoded": _fp8_decoded(q.cpu(), scale.cpu(), kwargs["block_size"])}


RANDOM = {"q": "skip", "scale": "close"}
REPRESENTABLE = {"decoded": "skip", "q": "exact", "scale": "exact"}

register(Case(
    "quant.fp8_quantize", "quant", "quant.fp8_quantize", reference=ref.fp8_quantize, requires=("fp8",),
    outputs=_fp8_quantize_outputs, tolerances=CODEC_TOL,
    samples=(
        Sample("per_tensor_T33_D64_representable", _fp8_quantize((33, 64)), compare=REPRESENTABLE),
        Sample("block128_T9_D256_representable", _fp8_quantize((9, 256), block=128), compare=REPRESENTABLE),
        Sample("block32_T17_D64_random", _fp8_quantize((17, 64), block=32, representable=False), compare=RANDOM),
        Sample("static_scale_T12_D64_random_saturating",
               _fp8_quantize((12, 64), representable=False, static_scale=0.01), compare=RANDOM),
    ),
    doc="x / scale to e4m3fn with amax / 448 scales (per tensor, per block) or a static scale."))


def _fp8_dequantize(shape, *, block=None, pow2=True):
    def make(g, dtype):
        q = fp8_codes(g, shape).to(torch.float8_e4m3fn)
        sshape = () if block is None else (*shape[:-1], shape[-1] // block)
        if pow2:
            scale = torch.exp2(torch.randint(-12, 4, sshape, generator=g).double()).float()
        else:
            scale = torch.rand(sshape, generator=g, dtype=torch.float64).add(0.01).float()
        return Inputs((q, scale), {"block_size": block, "dtype": dtype})
    return make


register(Case(
    "quant.fp8_dequantize", "quant", "quant.fp8_dequantize", reference=ref.fp8_dequantize, requires=("fp8",),
    outputs=lambda o, a, k: {"x": o},
    samples=(
        Sample("per_tensor_T33_D64_pow2_scale", _fp8_dequantize((33, 64)), compare={"x": "exact"}),
        Sample("block128_T9_D256_random_scales", _fp8_dequantize((9, 256), block=128, pow2=False)),
        Sample("block64_T5_D128_pow2_scales", _fp8_dequantize((5, 128), block=64), compare={"x": "exact"}),
    ),
    doc="q * scale in the requested dtype."))


# ---------------------------------------------------------------------------------- mxfp4

def _mxfp4_quantize(shape, *, representable=True):
    def make(g, dtype):
        x = representable_mxfp4(g, shape) if representable else block_pow2(g, randn(g, shape, torch.float64), 32,
                                                                             -10, 6)
        return Inputs((x.to(dtype),))
    return make


def _mxfp4_outputs(result, args, kwargs):
    packed, scales = result.packed, result.scales
    return {"packed": packed, "scales": scales,
            "decoded": ref.mxfp4_dequantize(packed.cpu(), scales.cpu(), dtype=torch.float64)}


MX_RANDOM = {"packed": "skip", "scales": "exact"}
MX_REPRESENTABLE = {"decoded": "skip"}

register(Case(
    "quant.mxfp4_quantize", "quant", "quant.mxfp4_quantize", reference=ref.mxfp4_quantize,
    outputs=_mxfp4_outputs, tolerances=CODEC_TOL,
    samples=(
        Sample("T33_D128_representable", _mxfp4_quantize((33, 128)), compare=MX_REPRESENTABLE),
        Sample("E2_O8_I64_expert_weights_representable", _mxfp4_quantize((2, 8, 64)), compare=MX_REPRESENTABLE),
        Sample("T17_D64_random_wide_range", _mxfp4_quantize((17, 64), representable=False), compare=MX_RANDOM),
    ),
    doc="OCP MXFP4: E2M1 codes (low nibble first) and E8M0 block scales."))


def _mxfp4_dequantize(shape, lo=110, hi=140):
    def make(g, dtype):
        packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(lo, hi, (*shape[:-1], shape[-1] // 32), generator=g, dtype=torch.uint8)
        return Inputs((packed, scales), {"dtype": dtype})
    return make


register(Case(
    "quant.mxfp4_dequantize", "quant", "quant.mxfp4_dequantize", reference=ref.mxfp4_dequantize,
    outputs=lambda o, a, k: {"x": o}, compare={"x": "exact"},
    samples=(
        Sample("T33_D128", _mxfp4_dequantize((33, 128))),
        Sample("E2_O16_I64_expert_weights", _mxfp4_dequantize((2, 16, 64))),
    ),
    doc="code * 2^(scale - 127), exact in every activation dtype within range."))


# ---------------------------------------------------------------------------------- nvfp4

def _nvfp4_quantize(shape, *, representable=True, global_scale=None):
    def make(g, dtype):
        if representable:     # block scales on the e4m3 grid, global 2^-10, block max code 6
            blocks = (*shape[:-1], shape[-1] // 16)
            s_b = fp8_codes(g, blocks).abs().clamp_min(2.0 ** -6).to(torch.float8_e4m3fn).double()
            s_b.view(-1)[torch.randint(0, s_b.numel(), (1,), generator=g)] = 448.0
            codes = pin_block_max(g, e2m1_values(g, shape), 16, 6.0)
            x = (codes.reshape(*blocks, 16) * s_b[..., None] * 2.0 ** -10).reshape(shape)
        else:
            x = randn(g, shape, torch.float64, 2.0)
        kw = {} if global_scale is None else {"global_scale": torch.tensor(global_scale, dtype=torch.float32)}
        return Inputs((x.to(dtype),), kw)
    return make


def _nvfp4_outputs(result, args, kwargs):
    packed, block_scales, gs = result.packed, result.block_scales, result.global_scale
    return {"packed": packed, "block_scales": block_scales, "global_scale": gs,
            "decoded": ref.nvfp4_dequantize(packed.cpu(), block_scales.cpu(), gs.cpu(), dtype=torch.float64)}


NV_RANDOM = {"packed": "skip", "block_scales": "skip", "global_scale": "close"}

register(Case(
    "quant.nvfp4_quantize", "quant", "quant.nvfp4_quantize", reference=ref.nvfp4_quantize,
    outputs=_nvfp4_outputs, tolerances=CODEC_TOL,
    samples=(
        Sample("T16_D64_representable", _nvfp4_quantize((16, 64)),
               compare={"decoded": "skip", "block_scales": "exact", "global_scale": "exact"}),
        Sample("T8_D32_random", _nvfp4_quantize((8, 32), representable=False), compare=NV_RANDOM),
        Sample("T4_D64_random_given_global_scale", _nvfp4_quantize((4, 64), representable=False, global_scale=3e-3),
               compare=NV_RANDOM),
    ),
    doc="ModelOpt NVFP4: E2M1 codes, e4m3 block scales of 16, an fp32 global scale."))


def _nvfp4_dequantize(shape, *, pow2_global=True):
    def make(g, dtype):
        packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.uint8)
        block_scales = fp8_codes(g, (*shape[:-1], shape[-1] // 16)).abs().to(torch.float8_e4m3fn)
        gs = torch.tensor(2.0 ** -8 if pow2_global else 3.7e-3, dtype=torch.float32)
        return Inputs((packed, block_scales, gs), {"dtype": dtype})
    return make


register(Case(
    "quant.nvfp4_dequantize", "quant", "quant.nvfp4_dequantize", reference=ref.nvfp4_dequantize,
    outputs=lambda o, a, k: {"x": o},
    samples=(
        Sample("T8_D64_pow2_global", _nvfp4_dequantize((8, 64)), compare={"x": "exact"}),
        Sample("T4_D32_random_global", _nvfp4_dequantize((4, 32), pow2_global=False)),
    ),
    doc="code * block scale * global scale."))
