"""FP4 E2M1 elements and the MXFP4 codec: worked example, nibble order, exact round trips,
round-half-to-even against a brute-force nearest search, error bound, MXFP4Tensor."""

from __future__ import annotations

import math

import pytest
import torch

from k3.quant.fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from k3.quant.mxfp4 import MXFP4Tensor, mxfp4_dequantize, mxfp4_quantize

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nearest_code(v: float) -> int:
    """Independent E2M1 rounding: nearest magnitude, ties to the even code, saturate at 6."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(a - MAGS[c]), c % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def _half_step(a: float) -> float:
    """Half the E2M1 grid spacing around magnitude a (a <= 6)."""
    return 0.25 if a < 2 else (0.5 if a < 4 else 1.0)


def test_worked_example_0xb3_scale_126():
    packed = torch.tensor([[0xB3] * 16], dtype=torch.uint8)
    scales = torch.tensor([[126]], dtype=torch.uint8)
    out = mxfp4_dequantize(packed, scales)
    assert out.shape == (1, 32) and out.dtype == torch.float32
    assert out[0, :2].tolist() == [0.75, -0.75]


def test_code_table():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1_decode(codes)
    assert vals.tolist() == list(E2M1_VALUES)
    assert torch.equal(torch.signbit(vals), codes >= 8)  # code 8 is -0


def test_nibble_order_low_nibble_is_even_element():
    codes = torch.tensor([3, 11, 0, 15, 7, 8], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [3 | 11 << 4, 0 | 15 << 4, 7 | 8 << 4]
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize("shape", [(2, 8), (3, 4, 64)], ids=lambda s: "x".join(map(str, s)))
def test_pack_unpack_random(shape):
    codes = torch.randint(0, 16, shape, generator=_gen(1), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_nibbles(packed), codes)


def test_e2m1_encode_ties_go_to_even_code():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor(mids + [-m for m in mids] + [6.5, 100.0, float("inf"), -7.0, -0.0, -0.1])
    got = e2m1_encode(x).tolist()
    assert got == [_nearest_code(v) for v in x.tolist()]
    assert all(c % 2 == 0 for c in got[:14])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_e2m1_encode_matches_brute_force(dtype):
    x = (torch.randn(4000, generator=_gen(2)) * 3).to(dtype)
    assert e2m1_encode(x).tolist() == [_nearest_code(v) for v in x.tolist()]


def _blocks_with_every_code(n_blocks: int, seed: int) -> torch.Tensor:
    """uint8 codes [n_blocks, 32]: all 16 codes (so the block max is 6) then 16 random codes."""
    g = _gen(seed)
    rest = torch.randint(0, 16, (n_blocks, 16), generator=g, dtype=torch.uint8)
    allc = torch.arange(16, dtype=torch.uint8).expand(n_blocks, 16)
    perm = torch.argsort(torch.rand(n_blocks, 32, generator=g), dim=-1)
    return torch.cat([allc, rest], dim=-1).gather(1, perm)


@pytest.mark.parametrize(
    "dtype,scale_bytes",
    [
        (torch.float32, [0, 1, 60, 120, 126, 127, 130, 200, 250]),
        (torch.float64, [0, 1, 127, 200, 253, 254]),
        (torch.bfloat16, [1, 100, 127, 200]),
    ],
    ids=["fp32", "fp64", "bf16"],
)
def test_every_code_and_scale_round_trips_exactly(dtype, scale_bytes):
    n = len(scale_bytes)
    codes = _blocks_with_every_code(n, seed=3)  # [n, 32]
    packed = pack_nibbles(codes)  # [n, 16]
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).unsqueeze(-1)  # [n, 1]
    x = mxfp4_dequantize(packed, scales, dtype=dtype)
    assert x.dtype == dtype and torch.isfinite(x).all()
    expect = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes.long()] * torch.exp2(
        torch.tensor(scale_bytes, dtype=torch.float64) - 127
    ).unsqueeze(-1)
    assert torch.equal(x.to(torch.float64), expect)
    p2, s2 = mxfp4_quantize(x)
    assert torch.equal(s2, scales) and torch.equal(p2, packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)], ids=lambda s: "x".join(map(str, s)))
def test_quantize_rule_and_error_bound(shape, dtype):
    g = _gen(4)
    mag = torch.exp2(torch.randint(-20, 20, (*shape[:-1], shape[-1] // 32, 1), generator=g).double())
    x = (torch.randn(*shape[:-1], shape[-1] // 32, 32, generator=g, dtype=torch.float64) * mag)
    x = x.reshape(shape).to(dtype)
    packed, scales = mxfp4_quantize(x)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == torch.uint8
    assert scales.shape == (*shape[:-1], shape[-1] // 32) and scales.dtype == torch.uint8
    y = mxfp4_dequantize(packed, scales, dtype=torch.float64)
    xs = x.double().reshape(-1, 32).tolist()
    ys, sc = y.reshape(-1, 32).tolist(), scales.reshape(-1).tolist()
    for xb, yb, s in zip(xs, ys, sc):
        amax = max(abs(v) for v in xb)
        assert s - 127 == math.floor(math.log2(amax)) - 2  # OCP shared exponent
        step = 2.0 ** (s - 127)
        for xv, yv in zip(xb, yb):
            v = xv / step
            assert yv == E2M1_VALUES[_nearest_code(v)] * step
            assert abs(xv - yv) <= (_half_step(min(abs(v), 6.0)) + max(abs(v) - 6.0, 0.0)) * step


def test_saturation_at_six():
    # amax = 7.5 -> shared_exp = floor(log2 7.5) - 2 = 0; 7.5 clips to 6, 7 clips to 6.
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([7.5, -7.0, 5.0, 0.3])
    packed, scales = mxfp4_quantize(x)
    assert scales.item() == 127
    assert mxfp4_dequantize(packed, scales)[0, :4].tolist() == [6.0, -6.0, 4.0, 0.5]


def test_zero_block_and_nan_scale():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.randn(32, generator=_gen(5))
    packed, scales = mxfp4_quantize(x)
    assert (scales != 255).all()
    y = mxfp4_dequantize(packed, scales)
    assert (y[0] == 0).all() and (y[1, :32] == 0).all()
    assert torch.isnan(mxfp4_dequantize(packed[:1, :16], torch.tensor([[255]], dtype=torch.uint8))).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="N % 32"):
        mxfp4_quantize(torch.randn(4, 48, generator=_gen(6)))
    with pytest.raises(ValueError, match="scales"):
        mxfp4_dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_dequantize(torch.zeros(4, 16), torch.zeros(4, 1, dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(4, 6, 64), (3, 32, 96)], ids=lambda s: "E{}xO{}xI{}".format(*s))
def test_mxfp4_tensor_stacked_experts(shape):
    w = torch.randn(*shape, generator=_gen(7))
    t = MXFP4Tensor.from_float(w)
    e, o, i = shape
    assert t.shape == torch.Size(shape)
    assert t.packed.shape == (e, o, i // 2) and t.scales.shape == (e, o, i // 32)
    full = t.dequantize(torch.float32)
    assert full.shape == shape
    for k in range(e):  # each expert equals a checkpoint-style [out, in/2] + [out, in/32] pair
        assert torch.equal(full[k], mxfp4_dequantize(t.packed[k], t.scales[k]))
        assert torch.equal(t.dequantize(torch.float32, index=k), full[k])
    sel = [e - 1, 0]
    assert torch.equal(t.dequantize(torch.float32, index=sel), full[sel])
    assert torch.equal(t.dequantize(torch.float32, index=torch.tensor(sel)), full[sel])
    assert torch.equal(t.dequantize(torch.bfloat16, index=sel), full[sel].bfloat16())


def test_mxfp4_tensor_validates():
    with pytest.raises(ValueError, match="scales"):
        MXFP4Tensor(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shape"):
        packed, scales = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
        MXFP4Tensor(packed, scales, torch.Size([2, 64]))
