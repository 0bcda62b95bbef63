"""The nvidia plugin's batch-invariant kernels (platforms/nvidia/invariant.py) under the Triton
interpreter: each of its own Triton entries gives a row the same bits alone and in batches of
several sizes (the attn_res step too, whose served launch options change at 64 tokens), hands
uncovered inputs to the torch invariant kernel, and the model case model.batch_invariance_bitwise
passes with the plugin's whole mode table (what the H200 step runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from k3 import reference as ref
from k3.conformance.cases import model_bitwise
from k3.conformance.driver import prompts
from k3.conformance.runner import RunContext
from k3.platform import select_platform
from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.plugin import KERNEL_TABLES, KernelSet

invariant = pytest.importorskip("k3.platforms.nvidia.invariant")


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_own_kernels_give_a_row_the_same_bits_in_any_batch(dtype):
    d, row = 64, 3
    x = torch.randn(65, d, generator=_g(0)).to(dtype)
    w = torch.randn(d, generator=_g(1)).to(dtype)
    blocks = torch.randn(65, 3, d, generator=_g(2)).to(dtype)
    query = torch.randn(d, generator=_g(3)).to(dtype)
    logits = torch.randn(65, 8, generator=_g(4))
    calls = {
        "rms_norm": lambda n: invariant.rms_norm(x[:n], w, 1e-5),
        "glu": lambda n: invariant.glu_activation(x[:n], activation="situ", beta=4.0, linear_beta=25.0),
        "attn_res": lambda n: invariant.attn_res_step(x[:n], x[:n] * 0.5, blocks[:n].clone(), query=query,
                                                      num_visible_blocks=2, write_index=None, eps=1e-5,
                                                      out_norm_weight=w, out_eps=1e-5).h,
        "select": lambda n: invariant.select_experts(logits[:n], top_k=2, correction_bias=torch.zeros(8)).weights,
    }
    for name, call in calls.items():
        rows = [call(n)[row] for n in (row + 1, 65)]           # the served attn_res step changes above 64
        assert all(torch.equal(r, rows[0]) for r in rows), name
    torch.testing.assert_close(calls["rms_norm"](65), ref.rms_norm(x, w, 1e-5),
                               **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


def test_uncovered_inputs_go_to_the_torch_invariant_kernels():
    x, w = torch.randn(5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert torch.equal(invariant.rms_norm(x, w, 1e-6), invariant_tables()["elementwise"].rms_norm(x, w, 1e-6))
    logits = torch.randn(4, 16, generator=_g(5))
    grouped = dict(top_k=2, correction_bias=torch.zeros(16), num_expert_group=4, topk_group=2)
    want = invariant_tables()["moe"].select_experts(logits, **grouped)
    got = invariant.select_experts(logits, **grouped)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.weights, want.weights)


@pytest.mark.slow
def test_the_model_on_the_nvidia_mode_table_is_bit_identical_in_batches_and_in_a_recompute(monkeypatch):
    """The CPU half of the H200 step (its Triton kernels interpreted): k3-tiny on every entry of
    the nvidia plugin's mode table; a prompt fed in random chunks of 1-3 tokens beside a
    companion, then two teacher-forced tokens, gives the logits of one prefill over the whole
    sequence bit for bit (model.batch_invariance_bitwise's parts, at a size the interpreter runs
    in seconds)."""
    platform = select_platform("reference", batch_invariant=True)
    platform.kernels = KernelSet(**{t.FAMILY: invariant.table(t.FAMILY) for t in KERNEL_TABLES},
                                 providers={}, batch_invariant=True)
    monkeypatch.setattr(model_bitwise, "select_platform", lambda name, batch_invariant: platform)
    ctx = RunContext(platform)
    _, model = model_bitwise._invariant_model(ctx, "k3-tiny", torch.float32)
    assert model.kernels.elementwise.rms_norm.__wrapped__ is invariant.rms_norm
    prompt, companion = prompts(7, [4, 2])
    forced = [5, 11]
    kw = dict(device="cpu", pages_each=3)
    batched = model_bitwise._generate(model_bitwise._Pool(platform, model, rows=2, seed=1, **kw), [prompt, companion],
                                      forced, steps=2, max_chunk=3, seed=3)
    whole = model_bitwise._Pool(platform, model, rows=1, seed=2, **kw).forward([prompt + forced[:1]], [0], [0],
                                                                                 all_logits=True)
    assert torch.equal(torch.stack(batched), whole[len(prompt) - 1:])
