"""Issue 32 item 1 under the interpreter: the variants of the nvidia kernel entries round at the
same points. The `variants` conformance cases run on the nvidia platform's served kernels (the
MLA decode's split counts, the KDA paths, the router's two forms), and the MoE experts' modes,
which the interpreter never picks by batch size (it runs "decode" at every size), are forced one
by one on the same tokens. Each check also fails with the variants as they were before issue 32
(K3_LEGACY_ROUNDING=1), so it is one that would have caught the fault."""

import pytest
import torch

from k3 import reference as ref
from k3.conformance import compare as cmp
from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform
from k3.quant.mxfp4 import MXFP4Tensor

kernel = pytest.importorskip("k3.platforms.triton_kernels.moe_mxfp4")
from kernel_tables import interpretable, nvidia_served  # noqa: E402

TINY = [i for i in items("full", ("variants",)) if i.dtype == "bfloat16" and interpretable(i)
        and i.sample.shape in ("H4_R64_Dn16_Dr16_Dv16", "N3_T12_H2_K16", "D7168_E128")]


def test_the_tiny_samples_are_there():
    assert {i.case.name for i in TINY} == {"variants.mla.decode", "variants.kda", "variants.moe.router_logits"}


@pytest.mark.parametrize("item", TINY, ids=lambda i: i.id)
def test_variants_case_with_the_served_kernels(item):
    outcome = run_item(RunContext(nvidia_served(select_platform("reference"))), item)
    assert outcome.passed, outcome.summary()


def test_the_mla_case_fails_with_split_relative_rounding(monkeypatch):
    """Before issue 32 the split kernel rounded p = exp(s - m) to bf16 against each split's own
    running maximum m: a query alone (32 splits on the interpreter's 4 'processors') and in a batch
    of 64 (one split) rounded differently."""
    monkeypatch.setenv("K3_LEGACY_ROUNDING", "1")
    item = next(i for i in TINY if i.case.name == "variants.mla.decode")
    outcome = run_item(RunContext(nvidia_served(select_platform("reference"))), item)
    assert not outcome.passed, outcome.summary()


def _mxfp4(g, e, out, fan_in):
    packed = torch.randint(0, 256, (e, out, fan_in // 2), generator=g, dtype=torch.uint8)
    return MXFP4Tensor(packed, torch.randint(119, 121, (e, out, fan_in // 32), generator=g, dtype=torch.uint8))


@pytest.fixture(scope="module")
def modes():
    """Each MoE mode's output for the same 6 bf16 tokens over 8 MXFP4 experts (top 2) at L = 128,
    I = 64, now and (key "legacy_<mode>") with K3_LEGACY_ROUNDING=1, and the float64 oracle's."""
    g = torch.Generator().manual_seed(32)
    t, e, k, l, i = 6, 8, 2, 128, 64
    x = torch.randn(t, l, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    w13, w2 = _mxfp4(g, e, 2 * i, l), _mxfp4(g, e, l, i)
    kw = {"activation": "situ", "beta": 4.0, "linear_beta": 25.0}
    out = {"oracle": ref.experts_forward(x.double(), w13, w2, weights.double(), ids, **kw)}
    with pytest.MonkeyPatch.context() as mp:
        for prefix in ("", "legacy_"):
            if prefix:
                mp.setenv("K3_LEGACY_ROUNDING", "1")
            for mode in ("decode", "gemv", "dequant"):
                out[prefix + mode] = kernel.experts_forward(x, w13, w2, weights, ids, mode=mode, **kw)
    return out


@pytest.mark.parametrize("mode", ["gemv", "dequant"])
def test_moe_modes_agree_at_the_rounding_points(modes, mode):
    """The gemv (decode batches of up to 16 tokens on the H200) and the grouped dequantised GEMMs
    (prefill chunks) against the in-kernel decode mode: within `compare.variants_agree`'s bound, and
    each within the usual bf16 tolerance of the float64 oracle."""
    result = cmp.variants_agree(mode, modes[mode], modes["decode"])
    assert result.passed, result.message
    assert cmp.close("oracle", modes[mode], modes["oracle"], cmp.Tolerance(2e-2, 1e-3)).passed


@pytest.mark.parametrize("mode", ["gemv", "decode"])
def test_moe_modes_as_they_were_fail_the_bound(modes, mode):
    """Before issue 32: the gemv summed each group's products in fp16 (fp16x2) and, like the decode
    mode, kept the gate/up and down products in fp32 where the dequant mode's bf16 GEMMs round
    them: each differs from the dequant mode by more than the bound."""
    assert torch.equal(modes["legacy_dequant"], modes["dequant"])          # the dequant mode did not change
    result = cmp.variants_agree(mode, modes["legacy_" + mode], modes["dequant"])
    assert not result.passed, f"ratio {result.ratio}"
