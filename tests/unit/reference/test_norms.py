"""Normalisations: the rounding orders and eps placements the model depends on (worked values,
not self-comparison)."""

import pytest
import torch

from k3 import reference as ref


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_rms_norm_worked_example():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)            # mean square 12.5
    w = torch.tensor([2.0, 0.5], dtype=torch.float64)
    want = torch.tensor([[3.0 * 2.0, 4.0 * 0.5]], dtype=torch.float64) / (12.5 + 1e-6) ** 0.5
    assert torch.allclose(ref.rms_norm(x, w, 1e-6), want, rtol=1e-14, atol=0)


def test_rms_norm_eps_matters_at_small_scale():
    """K3's eps 1e-5 against a mean square of the same size: sqrt(1.25e-5 + 1e-5) = 1.5e-2.5 =
    0.004743416490252569, so [3e-3 * 2, 4e-3 * 0.5] / 0.00474... (values computed by hand)."""
    x = torch.tensor([[3e-3, 4e-3]], dtype=torch.float64)           # mean square 1.25e-5
    w = torch.tensor([2.0, 0.5], dtype=torch.float64)
    want = torch.tensor([[1.2649110640673518, 0.4216370213557839]], dtype=torch.float64)
    assert torch.allclose(ref.rms_norm(x, w, 1e-5), want, rtol=1e-13, atol=0)


def test_rms_norm_rounds_before_the_weight_in_bf16():
    """KimiRMSNorm: normalise in fp32, cast to bf16, multiply by the bf16 weight in bf16. The
    other order (multiply in fp32, cast once) differs in the last bit for many elements."""
    x, w = _rand(64, 256, dtype=torch.bfloat16), _rand(256, seed=1, dtype=torch.bfloat16)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    k3_order = normed * w
    cast_once = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(torch.bfloat16)
    got = ref.rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, k3_order)
    assert not torch.equal(got, cast_once)          # the sample tells the two orders apart


def test_l2_norm_adds_eps_inside_the_sqrt():
    x = torch.tensor([[1e-4, 0.0]], dtype=torch.float64)
    # inside: 1e-4 / sqrt(1e-8 + 1e-6); outside (x / (|x| + eps)) would give 1e-4 / (1e-4 + 1e-6)
    got = ref.l2_norm(x, eps=1e-6)
    assert got[0, 0].item() == pytest.approx(1e-4 / (1e-8 + 1e-6) ** 0.5, rel=1e-12)
    assert got[0, 0].item() != pytest.approx(1e-4 / (1e-4 + 1e-6), rel=1e-3)
    y = ref.l2_norm(_rand(5, 128, dtype=torch.float64))
    assert torch.allclose(y.norm(dim=-1), torch.ones(5, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_gated_rms_norm_is_computed_in_fp32_and_cast_once(activation):
    x, gate, w = _rand(8, 128, dtype=torch.bfloat16), _rand(8, 128, seed=2, dtype=torch.bfloat16), _rand(128, seed=3)
    xf, gf = x.float(), gate.float()
    act = torch.sigmoid(gf) if activation == "sigmoid" else torch.nn.functional.silu(gf)
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w * act).to(torch.bfloat16)
    assert torch.equal(ref.gated_rms_norm(x, gate, w, 1e-5, activation=activation), want)
    with pytest.raises(ValueError, match="unknown activation"):
        ref.gated_rms_norm(x, gate, w, 1e-5, activation="relu")


def test_layer_norm_matches_the_definition():
    x, w, b = _rand(4, 128, dtype=torch.float64), _rand(128, seed=4, dtype=torch.float64), _rand(128, seed=5,
                                                                                              dtype=torch.float64)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    assert torch.allclose(ref.layer_norm(x, w, b, 1e-6), (x - mean) / torch.sqrt(var + 1e-6) * w + b, atol=1e-12)
    assert ref.layer_norm(x.to(torch.bfloat16), w, b, 1e-6).dtype == torch.bfloat16
