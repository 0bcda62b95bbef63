"""The batched chunked KDA prefill (platforms/torch_kernels/kda_chunked_blocked.py) against
k3.reference.kda_chunked: every `kda.chunked` conformance sample (ragged sequences, checkpoints
at chunk and mid-chunk offsets, initial states, float64) with it in place of the reference op;
strong decays (a softplus-style gate far past what fp32 could exponentiate as e^(-G)), chunk
sizes and the reference's errors for malformed input."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked as torch_chunked
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked
from kernel_tables import run_with, samples

CASES = samples("kda.chunked", float64=True)


def test_every_sample_is_collected():
    assert len(CASES) >= 9


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples(item):
    outcome = run_with(item, "kda", chunked=blocked.kda_chunked)
    assert outcome.passed, outcome.summary()


@pytest.mark.parametrize("item", samples("model.greedy", float64=True), ids=lambda i: i.id)
def test_the_tiny_models_with_it(item):
    """The whole tiny models with it serving every prefill chunk (7 tokens a call, mixed with
    decodes), against the reference model and the float64 oracle."""
    outcome = run_with(item, "kda", chunked=blocked.kda_chunked)
    assert outcome.passed, outcome.summary()


def _inputs(t, h=3, kd=32, vd=24, decay=1.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, h, kd, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, t, h, kd, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(1, t, h, vd, generator=g, dtype=dtype)
    gate = -decay * torch.rand(1, t, h, kd, generator=g, dtype=dtype)          # log decays <= 0
    beta = torch.rand(1, t, h, generator=g, dtype=dtype)
    return q, k, v, gate, beta


@pytest.mark.parametrize("decay", [0.05, 1.0, 30.0])     # 30: e^(G_i - G_j) spans e^-1900 in a chunk
@pytest.mark.parametrize("chunk", [16, 64])
def test_ragged_checkpoints_and_strong_decay_match_the_reference(decay, chunk):
    q, k, v, g, beta = _inputs(150, decay=decay)
    cu = torch.tensor([0, 37, 37 + 90, 150])
    s0 = torch.randn(3, 3, 32, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    offsets = torch.tensor([[5, 37], [64, 70], [0, 23]])
    kw = dict(initial_state=s0, cu_seqlens=cu, chunk_size=chunk, checkpoint_offsets=offsets)
    want = ref.kda_chunked(q, k, v, g, beta, **kw)
    got = blocked.kda_chunked(q, k, v, g, beta, **kw)
    for a, b in zip((got.o, got.state, *got.checkpoints), (want.o, want.state, *want.checkpoints)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fp32_inputs_stay_close_to_float64():
    q, k, v, g, beta = _inputs(130, decay=2.0, dtype=torch.float64)
    want = ref.kda_chunked(q, k, v, g, beta).o
    out = blocked.kda_chunked(*(x.float() for x in (q, k, v, g, beta)))
    got, state = out.o, out.state
    assert state.dtype == torch.float32 and got.dtype == torch.float32
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-5, err


def test_other_chunk_sizes_and_malformed_input_go_to_the_reference():
    q, k, v, g, beta = _inputs(20)
    torch.testing.assert_close(blocked.kda_chunked(q, k, v, g, beta, chunk_size=7).o,      # the WY kernel serves it
                               torch_chunked.kda_chunked(q, k, v, g, beta, chunk_size=7).o, rtol=0, atol=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        blocked.kda_chunked(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="beta must be"):
        blocked.kda_chunked(q, k, v, g, beta[..., :1])
