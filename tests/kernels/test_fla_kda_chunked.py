"""The fla-core chunked prefill wrapper (platforms/triton_kernels/kda_chunked.py): its cutting
of sequences into rounds at checkpoint offsets, checked on the CPU with a stand-in for
fla-core's kernel that computes the same function (the reference on one round's pieces).
fla-core's kernel itself is checked on the GPU by `k3 conformance --platform nvidia`."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked as torch_chunked
from k3.platforms.triton_kernels import kda_chunked as wrapper

H, HV, K, V = 1, 2, 16, 8


def stand_in(calls):
    def fla_call(q, k, v, g, beta, scale, initial_state, cu_seqlens):
        assert q.shape[0] == 1 and initial_state.dtype == torch.float32 and cu_seqlens.dtype == torch.int64
        assert int(cu_seqlens[-1]) == q.shape[1] and len(cu_seqlens) == initial_state.shape[0] + 1
        calls.append(cu_seqlens.tolist())
        out = ref.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
        return out.o, out.state                   # fla-core's chunk_kda returns (o, final state)
    return fla_call


@pytest.fixture(autouse=True)
def cutting_in_float32(monkeypatch):
    """The cutting is dtype-agnostic; float32 (served by the reference, not fla-core) makes the
    stand-in's comparison exact, so these tests let the wrapper take it."""
    monkeypatch.setattr(wrapper, "FLA_DTYPES", (torch.bfloat16, torch.float16, torch.float32))


def inputs(lens, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = ref.l2_norm(torch.randn(1, t, H, K, generator=g)).to(dtype)
    k = ref.l2_norm(torch.randn(1, t, H, K, generator=g)).to(dtype)
    v = torch.randn(1, t, HV, V, generator=g).to(dtype)
    gate = -5 * torch.sigmoid(torch.randn(1, t, HV, K, generator=g))
    beta = torch.sigmoid(torch.randn(1, t, HV, generator=g))
    s0 = torch.randn(len(lens), HV, K, V, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (q, k, v, gate, beta), {"initial_state": s0, "cu_seqlens": cu}


def close(a, b):
    assert (a.double() - b.double()).norm() <= 1e-5 * b.double().norm() + 1e-6


@pytest.mark.parametrize("offsets", [
    None,
    [0, 5, 13],                                  # shared by every sequence (13 = the shortest's length)
    torch.tensor([[13, 0, 13], [3, 3, 17], [1, 20, 9]]),   # per sequence, unsorted, repeated, 0 and len
])
def test_rounds_match_the_reference(offsets):
    lens = [13, 17, 20]
    args, kw = inputs(lens, seed=1)
    calls = []
    got = wrapper.kda_chunked(*args, **kw, checkpoint_offsets=offsets, fla_call=stand_in(calls))
    want = ref.kda_chunked(*args, **kw, checkpoint_offsets=offsets)
    close(got.o, want.o)
    close(got.state, want.state)
    assert len(got.checkpoints) == len(want.checkpoints) == (0 if offsets is None else 3)
    for a, b in zip(got.checkpoints, want.checkpoints):
        close(a, b)
    assert len(calls) == (1 if offsets is None else 3)  # rounds = most pieces of any sequence


def test_a_single_sequence_is_cut_into_views_and_batches_flatten():
    args, kw = inputs([40], seed=2)
    calls = []
    got = wrapper.kda_chunked(*args, **kw, checkpoint_offsets=[16, 32], fla_call=stand_in(calls))
    want = ref.kda_chunked(*args, **kw, checkpoint_offsets=[16, 32])
    assert calls == [[0, 16], [0, 16], [0, 8]]
    for a, b in zip([got.o, got.state, *got.checkpoints], [want.o, want.state, *want.checkpoints]):
        close(a, b)
    q, k, v, g, beta = (x.reshape(2, 20, *x.shape[2:]) for x in args)          # [B=2, T=20] without cu_seqlens
    s0 = kw["initial_state"].repeat(2, 1, 1, 1)
    got = wrapper.kda_chunked(q, k, v, g, beta, initial_state=s0, fla_call=stand_in([]))
    want = ref.kda_chunked(q, k, v, g, beta, initial_state=s0)
    close(got.o, want.o)
    close(got.state, want.state)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_precision_goes_to_the_reference(monkeypatch, dtype):
    monkeypatch.undo()                            # the served dtypes, not the fixture's
    args, kw = inputs([5, 7], seed=3, dtype=dtype)

    def never(*a):
        raise AssertionError(f"fla-core must not take {dtype} (float32: its dots round to TF32)")

    got = wrapper.kda_chunked(*args, **kw, fla_call=never)
    want = torch_chunked.kda_chunked(*args, **kw)           # the reference platform's kernel, bit for bit
    assert torch.equal(got.o, want.o) and torch.equal(got.state, want.state)


def test_the_plan_is_made_once_per_forward_and_shared_by_layers():
    """Every KDA layer of a forward passes the same cu_seqlens and offsets tensors: the cutting is
    planned once, and fla-core gets the same cu_seqlens tensor each time (its index cache hits)."""
    args, kw = inputs([13, 17, 20], seed=4)
    offsets = torch.tensor([[5, 13], [3, 17], [20, 9]])
    calls, cu_objects = [], []

    def recording(*a):
        cu_objects.append(a[-1])
        return stand_in(calls)(*a)

    for _layer in range(3):
        wrapper.kda_chunked(*args, **kw, checkpoint_offsets=offsets, fla_call=recording)
    plan = wrapper.round_plan(kw["cu_seqlens"], offsets, 1, 50, torch.device("cpu"))
    assert wrapper.round_plan(kw["cu_seqlens"], offsets, 1, 50, torch.device("cpu")) is plan
    assert len(calls) == 6 and calls[:2] == calls[2:4] == calls[4:]          # two rounds per layer
    assert cu_objects[0] is cu_objects[2] is cu_objects[4] and cu_objects[1] is cu_objects[3]
    fresh = kw["cu_seqlens"].clone()                  # next step's metadata: a new tensor, a new plan
    assert wrapper.round_plan(fresh, offsets, 1, 50, torch.device("cpu")) is not plan
    long_cu = kw["cu_seqlens"].long()                 # int64 cu_seqlens go to fla-core as they are
    assert wrapper.round_plan(long_cu, None, 1, 50, torch.device("cpu")).cu is long_cu


def test_fla_core_gets_fp32_operands_unless_asked_for_the_models_dtype(monkeypatch):
    """fla-core keeps its per-chunk states in its operands' dtype; bf16 ones failed a bf16 model
    conformance case on the H200, so q, k and v go to it in fp32 by default."""
    import sys
    import types

    seen = []

    def chunk_kda(q, k, v, g, beta, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return v.clone(), kw["initial_state"]

    kda_module = types.ModuleType("fla.ops.kda")
    kda_module.chunk_kda = chunk_kda
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.kda", kda_module)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(wrapper.fla_configs, "pin", lambda: None)
    (q, k, v, g, beta), kw = inputs([4, 5], seed=6, dtype=torch.bfloat16)
    monkeypatch.delenv(wrapper.OPERANDS_ENV, raising=False)
    wrapper.fla_chunk_kda(q, k, v, g, beta, 0.1, kw["initial_state"], kw["cu_seqlens"])
    monkeypatch.setenv(wrapper.OPERANDS_ENV, "bf16")
    wrapper.fla_chunk_kda(q, k, v, g, beta, 0.1, kw["initial_state"], kw["cu_seqlens"])
    assert seen == [(torch.float32,) * 3, (torch.bfloat16,) * 3]
    monkeypatch.setenv(wrapper.OPERANDS_ENV, "tf32")
    with pytest.raises(ValueError, match="fp32 or bf16"):
        wrapper.fla_chunk_kda(q, k, v, g, beta, 0.1, kw["initial_state"], kw["cu_seqlens"])
