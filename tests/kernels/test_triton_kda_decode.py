"""The fused KDA decode kernel (platforms/triton_kernels/kda_decode.py) against
k3.reference.kda_decode_step: two steps over poisoned state rows in both state layouts,
fresh and continuing rows, K3's bounded gate and Kimi-Linear's softplus gate."""

import math

import pytest
import torch

from k3 import reference as ref

kernel = pytest.importorskip("k3.platforms.triton_kernels.kda_decode")

H, K, W, ROWS, SLOTS = 2, 16, 4, 6, (4, 1, 5)
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def _rows(layout, dtype):
    rec = torch.full((ROWS, H, K, K), float("nan"), dtype=dtype)
    return rec if layout == "hkv" else rec.transpose(-1, -2).contiguous().transpose(-1, -2)


def _close(got, want, tol):
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "a row no sequence owns was written, or a NaN leaked"
    err = (got.double() - want)[~nan]
    assert err.norm() / want[~nan].norm() < tol


@pytest.mark.parametrize("layout", ["hkv", "hvk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3_gate", "softplus_gate"])
def test_matches_the_reference(layout, dtype, lower_bound):
    _two_steps_against_the_reference(layout, dtype, lower_bound, W)


@pytest.mark.parametrize("block_v", [4, 8])
@pytest.mark.parametrize("layout", ["hkv", "hvk"])
def test_state_row_in_column_blocks(layout, block_v):
    """The V-blocked path (the row in [K, block_v] tiles, window slid after the loop)."""
    _two_steps_against_the_reference(layout, torch.bfloat16, -5.0, W, block_v=block_v)
    _two_steps_against_the_reference(layout, torch.float32, None, 3, block_v=block_v)


@pytest.mark.parametrize("width", [2, 3])
def test_short_conv_widths(width):
    _two_steps_against_the_reference("hkv", torch.float32, -5.0, width)


def test_wider_convs_fall_back_to_the_reference():
    c = 3 * H * K
    assert kernel.covers(torch.zeros(1, c), torch.zeros(c, 4), torch.zeros(1, H, K), torch.zeros(1, H),
                         torch.zeros(ROWS, H, K, K), torch.zeros(ROWS, c, 3))
    assert not kernel.covers(torch.zeros(1, c), torch.zeros(c, 5), torch.zeros(1, H, K), torch.zeros(1, H),
                             torch.zeros(ROWS, H, K, K), torch.zeros(ROWS, c, 4))


def _two_steps_against_the_reference(layout, dtype, lower_bound, W, **launch):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dt=dtype, s=1.0, shift=0.0):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * s + shift).to(dt)

    c, n = 3 * H * K, len(SLOTS)
    conv_weight, a_log = randn(c, W, s=0.5), torch.rand(H, generator=g) * math.log(16)
    dt_bias, o_norm = randn(H, K, dt=torch.float32, s=0.5), randn(K, s=0.3, shift=1.0)
    mine = (_rows(layout, torch.float32), torch.full((ROWS, c, W - 1), float("nan"), dtype=dtype))
    oracle = (_rows(layout, torch.float64), torch.full((ROWS, c, W - 1), float("nan"), dtype=torch.float64))
    index = torch.tensor(SLOTS)
    for step in range(3):
        fresh = torch.tensor([step == 0, step == 2, False])                   # a row restarted at step 2
        inputs = (randn(n, c), conv_weight, randn(n, H, K), a_log, dt_bias, randn(n, H), randn(n, H, K), o_norm)
        kw = {"lower_bound": lower_bound, "norm_eps": 1e-5}
        got = kernel.kda_decode_step(*inputs, *mine, index, fresh, **kw, **launch)
        want = ref.kda_decode_step(*(x.double() for x in inputs), *oracle, index, fresh, **kw)
        assert got.dtype == dtype and got.shape == (n, H, K)
        _close(got, want, TOL[dtype])
        _close(mine[0], oracle[0], TOL[dtype])
        _close(mine[1], oracle[1], TOL[dtype])


def test_float64_falls_back_to_the_reference():
    assert not kernel.covers(torch.zeros(1, 3 * H * K, dtype=torch.float64), torch.zeros(3 * H * K, W),
                             torch.zeros(1, H, K), torch.zeros(1, H), torch.zeros(ROWS, H, K, K),
                             torch.zeros(ROWS, 3 * H * K, W - 1, dtype=torch.float64))
