"""SiTU / SiLU GLU: the worked table, bounds, limits, dtype rule, required beta."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3.reference.activations import glu_activation, silu_glu, situ, situ_glu

# (g, u, SiTU_4(g), SiTU-GLU with beta 4 / linear 25): k3-model-math section 7 and
# k3-architecture section 2.7.
TABLE = [
    (1.0, 2.0, 0.716200, 1.429351),
    (10.0, 40.0, 3.946278, 90.929009),
    (-3.0, 1.0, -0.120490, -0.120426),
    (0.5, -0.5, None, -0.154789),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _glu_input(g: list[float], u: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([g + u], dtype=dtype)  # [1, 2I] = [gate | up]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_worked_table(dtype):
    g, u = [r[0] for r in TABLE], [r[1] for r in TABLE]
    out = situ_glu(_glu_input(g, u, dtype), beta=4.0, linear_beta=25.0)
    assert out.dtype == dtype and out.shape == (1, len(TABLE))
    # the table has 6 decimals; fp32 adds ~1e-7 relative
    assert out[0].tolist() == pytest.approx([r[3] for r in TABLE], rel=1e-6, abs=1e-6)
    s = situ(torch.tensor(g, dtype=dtype), beta=4.0)
    for got, row in zip(s.tolist(), TABLE):
        if row[2] is not None:
            assert got == pytest.approx(row[2], abs=1e-6)


@pytest.mark.parametrize("shape", [(7, 2 * 33), (2, 3, 2 * 16)], ids=lambda s: "x".join(map(str, s)))
def test_matches_formula_float64(shape):
    x = torch.randn(*shape, generator=_gen(1), dtype=torch.float64) * 8
    i = shape[-1] // 2
    g, u = x[..., :i].reshape(-1).tolist(), x[..., i:].reshape(-1).tolist()
    sig = [1 / (1 + math.exp(-a)) for a in g]
    want = [3.0 * math.tanh(a / 3.0) * s * 20.0 * math.tanh(b / 20.0) for a, s, b in zip(g, sig, u)]
    got = situ_glu(x, beta=3.0, linear_beta=20.0)
    assert got.shape == (*shape[:-1], i)
    assert got.reshape(-1).tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    uncapped = [3.0 * math.tanh(a / 3.0) * s * b for a, s, b in zip(g, sig, u)]
    assert situ_glu(x, beta=3.0).reshape(-1).tolist() == pytest.approx(uncapped, rel=1e-12, abs=1e-12)


def test_bounds():
    x = torch.randn(4096, 64, generator=_gen(2), dtype=torch.float64) * 50
    out = situ_glu(x, beta=4.0, linear_beta=25.0)
    assert out.abs().max().item() <= 100.0  # < 100 in exact arithmetic; tanh rounds to 1
    s = situ(x, beta=4.0)
    assert s.max().item() <= 4.0 and s.min().item() >= -0.2699


def test_large_beta_tends_to_swiglu():
    x = torch.randn(8, 64, generator=_gen(3), dtype=torch.float64)
    big = situ_glu(x, beta=1e6, linear_beta=1e6)
    assert torch.allclose(big, silu_glu(x), rtol=1e-6, atol=1e-9)


def test_silu_glu():
    x = torch.randn(5, 2 * 12, generator=_gen(4), dtype=torch.float64)
    assert torch.allclose(silu_glu(x), F.silu(x[:, :12]) * x[:, 12:], rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_computes_in_fp32_and_casts_back(dtype):
    x = (torch.randn(16, 2 * 32, generator=_gen(5)) * 6).to(dtype)
    out = situ_glu(x, beta=4.0, linear_beta=25.0)
    assert out.dtype == dtype
    assert torch.equal(out, situ_glu(x.float(), beta=4.0, linear_beta=25.0).to(dtype))
    assert torch.equal(silu_glu(x), silu_glu(x.float()).to(dtype))
    assert torch.equal(situ(x, beta=4.0), situ(x.float(), beta=4.0).to(dtype))


def test_beta_is_required_and_checked():
    x = torch.randn(2, 8, generator=_gen(6))
    with pytest.raises(TypeError):
        situ_glu(x)  # beta is keyword-only and has no default
    with pytest.raises(ValueError, match="beta"):
        situ_glu(x, beta=None)
    with pytest.raises(ValueError, match="linear_beta"):
        situ_glu(x, beta=4.0, linear_beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        glu_activation(x, activation="situ")
    with pytest.raises(ValueError, match="activation"):
        glu_activation(x, activation="gelu")


def test_odd_width_raises():
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        situ_glu(torch.randn(2, 7, generator=_gen(7)), beta=4.0)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2I\]"):
        silu_glu(torch.randn(2, 7, generator=_gen(7)))


def test_glu_activation_dispatch():
    x = torch.randn(3, 16, generator=_gen(8))
    assert torch.equal(glu_activation(x, activation="situ", beta=4.0, linear_beta=25.0),
                       situ_glu(x, beta=4.0, linear_beta=25.0))
    assert torch.equal(glu_activation(x, activation="silu"), silu_glu(x))
