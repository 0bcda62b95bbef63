"""FP8 codec: exact round trip of every representable value, half-ulp error bound, zeros."""

from __future__ import annotations

import pytest
import torch

from k3.quant.fp8 import fp8_dequantize, fp8_max, fp8_quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
FP8_IDS = ["e4m3fn", "e4m3fnuz"]


def _finite_values(dtype: torch.dtype) -> torch.Tensor:
    """All 256 bit patterns of an fp8 dtype, the finite ones, as that dtype."""
    allv = torch.arange(256, dtype=torch.uint8).view(dtype)
    return allv[torch.isfinite(allv.to(torch.float32))]


def _half_ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the fp8 spacing at |v| (v already divided by the scale), fp64."""
    fi = torch.finfo(dtype)
    mag = v.abs().clamp_min(fi.smallest_normal)
    return 0.5 * fi.eps * torch.exp2(torch.floor(torch.log2(mag)))


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_fmax(dtype):
    assert fp8_max(dtype) == {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}[dtype]


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_every_finite_value_round_trips_with_scale_one(dtype, src):
    vals = _finite_values(dtype)
    q, s = fp8_quantize(vals.to(src), scale=1.0, dtype=dtype)
    assert s.dtype == torch.float32 and s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), vals.view(torch.uint8))
    assert torch.equal(fp8_dequantize(q, s), vals.to(torch.float32))


@pytest.mark.parametrize("block_size", [None, 32, 128], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("shape", [(7, 128), (3, 5, 256)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_random_round_trip_within_half_ulp(dtype, shape, block_size):
    g = torch.Generator().manual_seed(FP8.index(dtype) * 100 + len(shape) * 10 + (block_size or 0))
    # spread magnitudes over several octaves, so normals and subnormals both occur
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-12, 6, shape, generator=g).to(torch.float64))
    q, s = fp8_quantize(x, block_size=block_size, dtype=dtype)
    expect_scale_shape = () if block_size is None else (*shape[:-1], shape[-1] // block_size)
    assert q.dtype == dtype and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == expect_scale_shape
    amax = x.abs().amax() if block_size is None else x.reshape(*s.shape, -1).abs().amax(-1)
    torch.testing.assert_close(s.double(), amax / fp8_max(dtype), rtol=2**-23, atol=0)
    y = fp8_dequantize(q, s, block_size=block_size, dtype=torch.float64)
    sx = s.double() if block_size is None else s.double().repeat_interleave(block_size, -1)
    bound = _half_ulp(x / sx, dtype) * sx * (1 + 1e-6)
    assert (y - x).abs().le(bound).all()
    # the largest element of each block lands on (or within fp32 rounding of) fmax
    assert q.to(torch.float32).abs().max().item() == fp8_max(dtype)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_static_scale_saturates(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g) * 10
    q, s = fp8_quantize(x, scale=torch.tensor(0.01), dtype=dtype)
    assert s.item() == pytest.approx(0.01) and s.shape == ()
    y = fp8_dequantize(q, s)
    fmax = fp8_max(dtype)
    big = x.abs() > fmax * 0.01
    assert big.any() and torch.equal(y[big], torch.sign(x[big]) * fmax * s)


@pytest.mark.parametrize("block_size", [None, 16], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_zeros(dtype, block_size):
    x = torch.zeros(3, 32)
    x[1, 16:] = torch.randn(16, generator=torch.Generator().manual_seed(0))  # one nonzero block
    q, s = fp8_quantize(x, block_size=block_size, dtype=dtype)
    assert torch.isfinite(s).all() and (s > 0).all()
    y = fp8_dequantize(q, s, block_size=block_size)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(32)) and torch.equal(y[1, :16], torch.zeros(16))
    qz, sz = fp8_quantize(torch.zeros(5, 16), block_size=block_size, dtype=dtype)
    assert torch.equal(fp8_dequantize(qz, sz, block_size=block_size), torch.zeros(5, 16))


def test_bad_inputs():
    x = torch.randn(2, 100)
    with pytest.raises(ValueError, match="block_size"):
        fp8_quantize(x, block_size=128)
    with pytest.raises(ValueError, match="scale"):
        fp8_quantize(x, block_size=50, scale=torch.ones(3))
    with pytest.raises(ValueError, match="dtype"):
        fp8_quantize(x, dtype=torch.bfloat16)
    q, s = fp8_quantize(x, block_size=50)
    with pytest.raises(ValueError, match="scale"):
        fp8_dequantize(q, s[:, :1], block_size=50)
