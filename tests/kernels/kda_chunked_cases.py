"""Inputs and checks shared by the chunked KDA prefill's kernel tests (the Triton phases in
test_triton_kda_chunked_blocked.py, the split phase 1 in test_triton_kda_intra_split.py, the
split recurrence in test_triton_kda_chunked_state.py)."""

import torch

from k3 import reference as ref


def error_ratio(got, want) -> float:
    """|got - want| / |want| in float64 (Frobenius norms)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def nan_poisoned_empty(monkeypatch, module):
    """Make `module`'s torch.empty / empty_like return NaN-filled tensors (unwritten memory shows)."""
    monkeypatch.setattr(module.torch, "empty", lambda *a, **kw: torch.full(
        a if len(a) > 1 or not isinstance(a[0], tuple) else a[0], float("nan"), **kw))
    monkeypatch.setattr(module.torch, "empty_like", lambda x: torch.full_like(x, float("nan")))


def packed_phase1_inputs(rows, HV, K, V, seed, decay=1.0, spike_every=7):
    """Phase 1's packed inputs q, k, g [rows + 1, HV, K], v [rows + 1, HV, V], beta [rows + 1, HV]
    (a zero row last, what padding reads), log decays in [-decay, 0] with every spike_every-th row
    -50 (e^-50 a step: the masking above the diagonal matters)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows + 1, HV, K, generator=gen) / K ** 0.5
    k = ref.l2_norm(torch.randn(rows + 1, HV, K, generator=gen))
    v = torch.randn(rows + 1, HV, V, generator=gen)
    g = -decay * torch.rand(rows + 1, HV, K, generator=gen)
    g[::spike_every] = -50.0
    beta = torch.rand(rows + 1, HV, generator=gen)
    for x in (q, k, v, g, beta):
        x[-1] = 0
    return q, k, v, g, beta


def random_phase1_outputs(counts, HV, C, K, V, seed):
    """Random phase-1 outputs for sequences of `counts` chunks in `_segments`' round-major order
    (W, qeG, kdec scaled so the states stay O(1); A_qk lower triangular; eGC in (0, 1]):
    ((W, U, A_qk, qeG, kdec, eGC, initial states), order, sizes)."""
    gen = torch.Generator().manual_seed(seed)
    order = sorted(range(len(counts)), key=lambda n: -counts[n])
    sizes = [sum(c > r for c in counts) for r in range(max(counts))]
    nseg = sum(sizes)
    W, qeG, kdec = (torch.randn(nseg, HV, C, K, generator=gen) / K for _ in range(3))
    U = torch.randn(nseg, HV, C, V, generator=gen)
    A = (torch.randn(nseg, HV, C, C, generator=gen) / C).tril()
    eGC = torch.rand(nseg, HV, 1, K, generator=gen)
    h0 = torch.randn(len(counts), HV, K, V, generator=gen)
    return (W, U, A, qeG, kdec, eGC, h0), order, sizes


def ragged_prefill_inputs(lens, hv=2, kd=32, vd=32, decay=1.0, seed=0, dtype=torch.float32):
    """`kda_chunked`'s arguments for ragged sequences of `lens` tokens packed in one row: ((q, k,
    v, gate, beta), {"initial_state", "cu_seqlens"}), log decays in [-decay, 0] with every 11th
    token -50."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = ref.l2_norm(torch.randn(1, t, 1, kd, generator=gen)).to(dtype)
    k = ref.l2_norm(torch.randn(1, t, 1, kd, generator=gen)).to(dtype)
    v = torch.randn(1, t, hv, vd, generator=gen).to(dtype)
    gate = -decay * torch.rand(1, t, hv, kd, generator=gen)              # log decays <= 0
    gate[:, ::11] = -50.0                                                  # strong decays now and then
    beta = torch.rand(1, t, hv, generator=gen)
    s0 = torch.randn(len(lens), hv, kd, vd, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (q, k, v, gate, beta), {"initial_state": s0, "cu_seqlens": cu}


def float64_reference(args, kw, chunk, offsets):
    """k3.reference.kda_chunked on `ragged_prefill_inputs`' (args, kw) in float64, with chunk_size
    `chunk` and `offsets` as checkpoint_offsets: the truth the Triton wrappers are held to."""
    return ref.kda_chunked(*(a.double() for a in args), **{n: t.double() if t.is_floating_point() else t
                                                            for n, t in kw.items()},
                           chunk_size=chunk, checkpoint_offsets=offsets)


def assert_matches_reference(got, want, dtype):
    """o, the final states and every checkpoint finite and within 1e-5 of the float64 reference
    (error ratio), o within 1e-2 for bf16 inputs (fp32 compute on the inputs as given: the o of
    bf16 inputs is rounded to bf16 once)."""
    for a, b in zip((got.o, got.state, *got.checkpoints), (want.o, want.state, *want.checkpoints)):
        assert torch.isfinite(a).all()
        floor = 1e-2 if (dtype == torch.bfloat16 and a is got.o) else 1e-5
        assert error_ratio(a, b) < floor, error_ratio(a, b)
