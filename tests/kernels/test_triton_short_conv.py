"""The prefill short conv in Triton (platforms/triton_kernels/short_conv.py) against
k3.reference.short_conv: ragged sequences with cached windows (one shorter than the window),
equal-length batches without cu_seqlens, no state, checkpoint windows at offsets 0, inside and at
the end, widths 2 to 4, bf16 and fp32, SiLU or none."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import short_conv as torch_conv

kernel = pytest.importorskip("k3.platforms.triton_kernels.short_conv")


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_ragged_with_state_and_checkpoints(dtype, tol, width):
    g = torch.Generator().manual_seed(width)
    lens, c = [13, 2, 30], 40
    x = torch.randn(1, sum(lens), c, generator=g).to(dtype)
    w = torch.randn(c, width, generator=g).to(dtype) * 0.5
    state = torch.randn(3, c, width - 1, generator=g).to(dtype)
    offsets = torch.tensor([[0, 5, 13], [1, 2, 2], [30, 7, 0]])
    kw = dict(conv_state=state, cu_seqlens=_cu(lens), checkpoint_offsets=offsets)
    got, want = kernel.short_conv(x, w, **kw), ref.short_conv(x, w, **kw)
    assert ((got.y.double() - want.y.double()).norm() / want.y.double().norm()) < tol
    assert torch.equal(got.state, want.state)               # windows are copies of inputs
    assert len(got.checkpoints) == len(want.checkpoints) == 3
    for a, b in zip(got.checkpoints, want.checkpoints):
        assert torch.equal(a, b)


def test_equal_lengths_without_state_and_without_activation():
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(3, 11, 24, generator=g), torch.randn(24, 1, 4, generator=g)
    for activation in ("silu", None):
        got, want = kernel.short_conv(x, w, activation=activation), ref.short_conv(x, w, activation=activation)
        torch.testing.assert_close(got.y, want.y, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.state, want.state) and got.checkpoints == ()


def test_float64_goes_to_the_reference_platforms_kernel():
    x, w = torch.randn(1, 5, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    got, want = kernel.short_conv(x, w), torch_conv.short_conv(x, w)
    assert torch.equal(got.y, want.y) and torch.equal(got.state, want.state)
