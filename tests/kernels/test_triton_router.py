"""Expert selection in Triton (platforms/triton_kernels/router.py) against
k3.reference.select_experts: sigmoid with a correction bias (selection only), softmax without
renormalisation, K3's 896 experts top-16, a non-power-of-two expert count, exact ties; grouped
top-k and float64 fall back to the reference."""

import pytest
import torch

from k3 import reference as ref

kernel = pytest.importorskip("k3.platforms.triton_kernels.router")


@pytest.mark.parametrize("t, e, k, kw", [
    (37, 8, 2, dict(correction_bias=True)),
    (9, 16, 4, dict(scoring="softmax", renormalize=False)),
    (5, 896, 16, dict(correction_bias=True, routed_scaling_factor=2.446)),     # K3
    (6, 384, 8, dict(correction_bias=True, routed_scaling_factor=2.5)),
    (4, 100, 7, dict()),
], ids=["E8_k2_bias", "softmax_no_renorm", "k3_E896_k16", "E384_k8", "E100_k7"])
def test_matches_the_reference(t, e, k, kw):
    g = torch.Generator().manual_seed(e)
    logits = torch.randn(t, e, generator=g)
    if kw.pop("correction_bias", False):
        kw["correction_bias"] = 0.1 * torch.randn(e, generator=g)
    got, want = kernel.select_experts(logits, top_k=k, **kw), ref.select_experts(logits, top_k=k, **kw)
    got_w, got_ids, want_w, want_ids = got.weights, got.ids, want.weights, want.ids
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)


def test_exact_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0]])
    chosen = kernel.select_experts(logits, top_k=2)
    assert chosen.ids.tolist() == [[1, 2]] and torch.allclose(chosen.weights, torch.full((1, 2), 0.5))


def test_grouped_and_float64_fall_back():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g)
    kw = dict(top_k=6, num_expert_group=8, topk_group=4, correction_bias=torch.randn(64, generator=g))
    assert not kernel.covers(logits, 8)
    for x in (logits, logits.double()):
        got, want = kernel.select_experts(x, **kw), ref.select_experts(x, **kw)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.weights, want.weights)


@pytest.mark.parametrize("t, e, d, dtype, block_t, block_d", [
    (1, 128, 7168, torch.bfloat16, None, None),        # k3-slice's router at one token
    (3, 8, 96, torch.float32, None, None),
    (4, 12, 200, torch.bfloat16, 2, 64),                # two token blocks, columns past the last step
    (2, 4, 64, torch.float16, None, None),
], ids=["k3_slice_T1", "fp32_T3", "bf16_T4_two_blocks_ragged", "fp16_T2"])
def test_router_logits_match_the_reference(t, e, d, dtype, block_t, block_d, monkeypatch):
    """fp32 logits of bf16 / fp16 / fp32 token rows against the fp32 gate, in a NaN-filled output
    (every logit written), against the reference's upcast product in float64."""
    g = torch.Generator().manual_seed(t + e)
    h = torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(e, d, generator=g) * d ** -0.5
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    got = kernel.router_logits(h, w, block_t=block_t, block_d=block_d)
    monkeypatch.undo()
    want = ref.router_logits(h.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (t, e)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_router_logits_of_prefill_batches_and_float64_go_to_the_reference():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 32, generator=g)
    for h in (torch.randn(kernel.LOGITS_MAX_TOKENS + 1, 32, generator=g), torch.randn(2, 32, generator=g).double()):
        assert not kernel.logits_cover(h, w.to(h.dtype))
        torch.testing.assert_close(kernel.router_logits(h, w.to(h.dtype)), ref.router_logits(h, w.to(h.dtype)))
