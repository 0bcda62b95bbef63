"""The fused RMSNorm (platforms/triton_kernels/rms_norm.py) against k3.reference.rms_norm: every
`elementwise.rms_norm` conformance sample, strided rows (MLA's latent slice), no weight, an empty
batch, and rounding where the reference rounds (bf16 bit-exact but for summation order)."""

import pytest
import torch

from k3 import reference as ref

from kernel_tables import run_with, samples

kernel = pytest.importorskip("k3.platforms.triton_kernels.rms_norm")


@pytest.mark.parametrize("item", samples("elementwise.rms_norm"), ids=lambda i: i.id)
def test_conformance_samples(item):
    outcome = run_with(item, "elementwise", rms_norm=kernel.rms_norm)
    assert outcome.passed, outcome.summary()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_strided_rows_and_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    latent = (torch.randn(7, 576, generator=g) * 3).to(dtype)   # normalise the first 512 columns only
    weight = (torch.randn(512, generator=g) * 0.2 + 1).to(dtype)
    got = kernel.rms_norm(latent[:, :512], weight, 1e-6)
    want = ref.rms_norm(latent[:, :512], weight, 1e-6)
    assert got.dtype == dtype and got.shape == (7, 512) and got.is_contiguous()
    if dtype != torch.float32:                                  # rounded to 8 / 11 bits: equal but for
        assert (got != want).float().mean() < 0.01              # the summation order's last-ulp flips
    assert ((got.double() - want.double()).norm() / want.double().norm()) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_no_weight_leading_axes_and_empty():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 48, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(kernel.rms_norm(x, None, 1e-5), ref.rms_norm(x, None, 1e-5), atol=0, rtol=1e-2)
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    assert kernel.rms_norm(empty, torch.ones(64, dtype=torch.bfloat16), 1e-5).shape == (0, 64)


def test_float64_goes_to_the_reference(monkeypatch):
    monkeypatch.setattr(kernel, "_rms_norm_kernel", None)       # a launch would fail
    x = torch.randn(3, 40, dtype=torch.float64)
    assert torch.equal(kernel.rms_norm(x, None, 1e-5), ref.rms_norm(x, None, 1e-5))
