"""NVFP4 codec (ModelOpt convention): exact round trip of representable values, default global
scale, rounding against a brute-force nearest search, error bound, zeros, bad shapes."""

from __future__ import annotations

import math

import pytest
import torch

from k3.quant.fp4 import E2M1_VALUES, pack_nibbles
from k3.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nearest_code(v: float) -> int:
    """Independent E2M1 rounding: nearest magnitude, ties to the even code, saturate at 6."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(a - MAGS[c]), c % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def _half_step(a: float) -> float:
    return 0.25 if a < 2 else (0.5 if a < 4 else 1.0)


def _representable(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [rows, n] with a +-6 in every 16-block, and positive E4M3 block scales [rows, n/16]."""
    g = _gen(seed)
    codes = torch.randint(0, 16, (rows, n // 16, 16), generator=g, dtype=torch.uint8)
    pos = torch.randint(0, 16, (rows, n // 16, 1), generator=g)
    six = torch.where(torch.rand(rows, n // 16, 1, generator=g) < 0.5, 7, 15).to(torch.uint8)
    codes = codes.scatter(2, pos, six).reshape(rows, n)
    # E4M3 scales between 2^-6 and 448 (normal range), exactly representable.
    s = torch.exp2(torch.empty(rows, n // 16).uniform_(-6, 8.8, generator=g))
    return codes, s.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("global_scale", [0.01, 1.0, 3.5e-5], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("shape", [(3, 32), (5, 128)], ids=lambda s: "x".join(map(str, s)))
def test_representable_values_round_trip(shape, global_scale):
    codes, bscales = _representable(*shape, seed=11)
    packed = pack_nibbles(codes)
    gs = torch.tensor(global_scale, dtype=torch.float32)
    x = nvfp4_dequantize(packed, bscales, gs)
    expect = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes.long()].reshape(shape[0], -1, 16)
    expect = (expect * (bscales.double() * gs.double()).unsqueeze(-1)).reshape(shape)
    assert torch.allclose(x.double(), expect, rtol=2**-22, atol=0)
    p2, s2, g2 = nvfp4_quantize(x, global_scale=gs)
    assert g2.dtype == torch.float32 and g2.dim() == 0 and g2.item() == gs.item()
    assert torch.equal(s2.view(torch.uint8), bscales.view(torch.uint8))
    assert torch.equal(p2, packed)


def test_default_global_scale_is_amax_over_2688():
    x = torch.randn(4, 64, generator=_gen(12)) * 3
    _, bscales, gs = nvfp4_quantize(x)
    assert gs.item() == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-6)
    assert bscales.float().max().item() == 448.0  # the block holding amax uses the full range


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 48)], ids=lambda s: "x".join(map(str, s)))
def test_rounding_and_error_bound(shape, dtype):
    g = _gen(13)
    mag = torch.exp2(torch.randint(-6, 6, (*shape[:-1], shape[-1] // 16, 1), generator=g).double())
    x = (torch.randn(*shape[:-1], shape[-1] // 16, 16, generator=g, dtype=torch.float64) * mag)
    x = x.reshape(shape).to(dtype)
    packed, bscales, gs = nvfp4_quantize(x)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == torch.uint8
    assert bscales.shape == (*shape[:-1], shape[-1] // 16) and bscales.dtype == torch.float8_e4m3fn
    y = nvfp4_dequantize(packed, bscales, gs, dtype=torch.float64)
    cd = torch.float64 if dtype == torch.float64 else torch.float32  # the codec's compute dtype
    step_cd = (bscales.to(cd) * gs.to(cd)).reshape(-1, 1)  # [blocks, 1]
    scaled = (x.to(cd).reshape(-1, 16) / step_cd).double().tolist()  # x / step, rounded as the codec does
    xs, ys = x.double().reshape(-1, 16).tolist(), y.reshape(-1, 16).tolist()
    rows = zip(xs, ys, scaled, step_cd.double().reshape(-1).tolist())
    for xb, yb, vb, st in rows:
        assert st > 0
        for xv, yv, v in zip(xb, yb, vb):
            assert yv == pytest.approx(E2M1_VALUES[_nearest_code(v)] * st, rel=1e-6, abs=0)
            bound = (_half_step(min(abs(v), 6.0)) + max(abs(v) - 6.0, 0.0)) * st
            assert abs(xv - yv) <= bound * (1 + 1e-6)


def test_zeros_and_tiny_blocks():
    packed, bscales, gs = nvfp4_quantize(torch.zeros(2, 32))
    assert gs.item() == 1.0 and (nvfp4_dequantize(packed, bscales, gs) == 0).all()
    x = torch.randn(1, 32, generator=_gen(14))
    x[0, 16:] = 0.0  # an all-zero block next to a normal one
    packed, bscales, gs = nvfp4_quantize(x)
    y = nvfp4_dequantize(packed, bscales, gs)
    assert bscales[0, 1].float().item() == 0.0 and (y[0, 16:] == 0).all()
    assert torch.isfinite(y).all()


def test_output_dtype_and_reciprocal_convention():
    x = torch.randn(2, 32, generator=_gen(15)).bfloat16()
    packed, bscales, gs = nvfp4_quantize(x)
    y32 = nvfp4_dequantize(packed, bscales, gs)
    assert nvfp4_dequantize(packed, bscales, gs, dtype=torch.bfloat16).dtype == torch.bfloat16
    # compressed-tensors stores 1 / global: passing its reciprocal reproduces the same values.
    ct_global = (1.0 / gs.double()).item()
    assert torch.allclose(nvfp4_dequantize(packed, bscales, 1.0 / ct_global), y32, rtol=1e-6, atol=0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="N % 16"):
        nvfp4_quantize(torch.randn(2, 24, generator=_gen(16)))
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_quantize(torch.randn(2, 32, generator=_gen(16)), global_scale=0.0)
    with pytest.raises(ValueError, match="block_scales"):
        bad = torch.zeros(2, 1).to(torch.float8_e4m3fn)  # [2, 1] where [2, 2] is expected
        nvfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), bad, 1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nvfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2), 1.0)
