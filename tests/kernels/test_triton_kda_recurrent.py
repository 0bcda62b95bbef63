"""Token-serial KDA in Triton (platforms/triton_kernels/kda_recurrent.py), the op behind
speculative verify: every `kda.recurrent` conformance sample (ragged batches, per-position
states, delta-rule corrections, no initial state, grouped value heads) with the kernel in place
of the reference op, under the interpreter; the float64 fallback and the shape errors."""

import pytest
import torch

from k3 import reference as ref
from kernel_tables import run_with, samples

kernel = pytest.importorskip("k3.platforms.triton_kernels.kda_recurrent")

CASES = samples("kda.recurrent")

def test_every_sample_is_collected():
    assert len(CASES) == 12 and any("corrections" in i.id for i in CASES)


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples_with_the_kernel(item):
    outcome = run_with(item, "kda", recurrent=kernel.kda_recurrent)
    assert outcome.passed, outcome.summary()


def _inputs(b, t, h, hv, k, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1).to(dtype)  # noqa: E731
    return (unit(b, t, h, k), unit(b, t, h, k), torch.randn(b, t, hv, v, generator=g).to(dtype),
            -torch.rand(b, t, hv, k, generator=g), torch.rand(b, t, hv, generator=g))


def test_equal_lengths_in_bf16_with_a_scale():
    args = _inputs(3, 5, 2, 4, 32, 64, torch.bfloat16)
    h0 = torch.randn(3, 4, 32, 64)
    got = kernel.kda_recurrent(*args, initial_state=h0, scale=0.3, output_per_position_states=True)
    want = ref.kda_recurrent(*args, initial_state=h0, scale=0.3, output_per_position_states=True)
    assert got.o.dtype == torch.bfloat16 and got.state.dtype == got.states.dtype == torch.float32
    assert got.corrections is None and want.corrections is None
    for a, b in ((got.o, want.o), (got.state, want.state), (got.states, want.states)):
        assert ((a.double() - b.double()).norm() / b.double().norm()) < 1e-2


def test_float64_and_odd_head_sizes_go_to_the_reference():
    args = _inputs(1, 3, 1, 1, 16, 16, torch.float64)
    assert not kernel.covers(*args, None)
    torch.testing.assert_close(kernel.kda_recurrent(*args).o, ref.kda_recurrent(*args).o)
    assert not kernel.covers(*_inputs(1, 3, 1, 1, 24, 16, torch.float32), None)


def test_a_wrong_initial_state_is_named():
    args = _inputs(2, 3, 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, HV, K, V\] = \[2, 2, 16, 16\]"):
        kernel.kda_recurrent(*args, initial_state=torch.zeros(2, 2, 16, 8))
