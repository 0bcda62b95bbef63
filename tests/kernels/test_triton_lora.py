"""The Triton LoRA kernels (platforms/triton_kernels/lora.py) under the interpreter against the
reference LoRA ops: every `lora.delta` / `lora.experts` conformance sample with the kernel in the
reference's place (error ratio and floor per dtype, poisoned freed memory), plus the grouping's
edges: rows of slot -1 exactly zero, one adapter on every row, rows of other ranks' experts, a
poisoned output buffer fully written, and the fallbacks."""

import pytest
import torch

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor

from kernel_tables import run_with, samples

kernel = pytest.importorskip("k3.platforms.triton_kernels.lora")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _ratio(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("item", samples("lora.delta"), ids=lambda i: i.id)
def test_delta_conformance_samples(item):
    outcome = run_with(item, "lora", delta=kernel.lora_delta)
    assert outcome.passed, outcome.summary()


@pytest.mark.parametrize("item", samples("lora.experts"), ids=lambda i: i.id)
def test_experts_conformance_samples(item):
    outcome = run_with(item, "lora", experts=kernel.lora_experts_forward)
    assert outcome.passed, outcome.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delta_segments_base_rows_and_bounds(dtype):
    """37 rows over 3 slots and the base model (-1) in random order, rank 8 padded to 16."""
    t, s, r, d_in, d_out = 37, 3, 8, 80, 72
    x = torch.randn(t, d_in, generator=_g(0)).to(dtype)
    a = (torch.randn(s, r, d_in, generator=_g(1)) * d_in ** -0.5).to(dtype)
    b = (torch.randn(s, d_out, r, generator=_g(2)) * r ** -0.5).to(dtype)
    scales = torch.tensor([0.5, 2.0, 1.0])
    slots = torch.randint(-1, s, (t,), generator=_g(3))
    got, want = kernel.lora_delta(x, a, b, scales, slots), ref.lora_delta(x, a, b, scales, slots)
    assert got.dtype == torch.float32 and got.shape == (t, d_out)
    assert _ratio(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got[slots < 0], torch.zeros_like(got[slots < 0]))        # the base model: exactly zero
    one = kernel.lora_delta(x, a, b, scales, torch.full((t,), 2))                  # one adapter on every row
    assert _ratio(one, ref.lora_delta(x, a, b, scales, torch.full((t,), 2))) < 1e-2
    assert torch.isfinite(one).all()


def test_delta_falls_back_for_float64_and_large_ranks():
    x, a, b = torch.randn(4, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64), \
        torch.randn(2, 24, 8, dtype=torch.float64)
    slots = torch.tensor([0, 1, -1, 0])
    assert torch.equal(kernel.lora_delta(x, a, b, torch.ones(2), slots), ref.lora_delta(x, a, b, torch.ones(2), slots))


def _experts(t, e, k, l, i, s, r, seed=0):
    packed = torch.randint(0, 256, (e, 2 * i, l // 2), generator=_g(seed), dtype=torch.uint8)
    w13 = MXFP4Tensor(packed, (122 + torch.randint(-1, 1, (e, 2 * i, l // 32), generator=_g(seed + 1))).to(torch.uint8))
    w2 = MXFP4Tensor(torch.randint(0, 256, (e, l, i // 2), generator=_g(seed + 2), dtype=torch.uint8),
                     (122 + torch.randint(-1, 1, (e, l, i // 32), generator=_g(seed + 3))).to(torch.uint8))
    ids = torch.stack([torch.randperm(e, generator=_g(seed + 10 + j))[:k] for j in range(t)])
    weights = torch.rand(t, k, generator=_g(seed + 4)) + 0.1
    lora = dict(w13_lora=[(slice(0, i), torch.randn(s, e, r, l, generator=_g(5)) * l ** -0.5,
                           torch.randn(s, e, i, r, generator=_g(6)) * r ** -0.5),
                          (slice(i, 2 * i), torch.randn(s, e, r, l, generator=_g(7)) * l ** -0.5,
                           torch.randn(s, e, i, r, generator=_g(8)) * r ** -0.5)],
                w2_lora=[(slice(0, l), torch.randn(s, e, r, i, generator=_g(9)) * i ** -0.5,
                          torch.randn(s, e, l, r, generator=_g(10)) * r ** -0.5)],
                scales=torch.rand(s, generator=_g(11)) + 0.5, activation="situ", beta=4.0, linear_beta=25.0)
    return torch.randn(t, l, generator=_g(seed + 12)), w13, w2, weights, ids, lora


def test_experts_with_adapters_other_ranks_and_base_rows():
    """Half the local experts (expert_start 4: the others' choices are another rank's), slots
    -1..2 mixed, an adapter only on w2 too: each equals the reference op."""
    x, w13, w2, weights, ids, lora = _experts(11, 8, 2, 64, 32, 3, 8)
    slots = torch.randint(-1, 3, (11,), generator=_g(20))
    local = (w13.packed[4:], w13.scales[4:]), (w2.packed[4:], w2.scales[4:])
    w13_l, w2_l = MXFP4Tensor(*local[0]), MXFP4Tensor(*local[1])
    half = dict(lora, w13_lora=[(c, a[:, 4:], b[:, 4:]) for c, a, b in lora["w13_lora"]],
                w2_lora=[(c, a[:, 4:], b[:, 4:]) for c, a, b in lora["w2_lora"]])
    for kw in (half, dict(half, w13_lora=[])):
        got = kernel.lora_experts_forward(x, w13_l, w2_l, weights, ids, slots, expert_start=4, **kw)
        want = ref.lora_experts_forward(x, w13_l, w2_l, weights, ids, slots, expert_start=4, **kw)
        assert _ratio(got, want) < 1e-5
    base = torch.full((11,), -1)
    from k3.platforms.triton_kernels import moe_mxfp4
    assert _ratio(kernel.lora_experts_forward(x, w13, w2, weights, ids, base, **lora),
                  moe_mxfp4.experts_forward(x, w13, w2, weights, ids, activation="situ", beta=4.0,
                                            linear_beta=25.0)) < 1e-6


def test_every_grouped_row_is_written_into_a_poisoned_buffer():
    """grouped_delta's shrink rows: a group with 17 rows spans two tiles, a one-row group one."""
    x = torch.randn(18, 32, generator=_g(0))
    groups = torch.tensor([0] * 17 + [1])
    a, b = torch.randn(2, 4, 32, generator=_g(1)), torch.randn(2, 16, 4, generator=_g(2))
    got = kernel.grouped_delta(x, torch.arange(18), groups, a, b, torch.ones(2))
    want = torch.stack([b[gr] @ (a[gr] @ x[j]) for j, gr in enumerate(groups.tolist())])
    assert torch.isfinite(got).all() and _ratio(got, want) < 1e-6
