"""KDA: gate, recurrence, chunked form, checkpoints, rollback. Every property is checked on both
implementations of each entry: the naive oracle (k3.reference) and the torch kernel the
reference platform serves (k3.platforms.torch_kernels), and the two are compared directly."""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from k3 import reference as ref
from k3.ops_helpers import prepare_kda_inputs
from k3.platforms.torch_kernels import kda_chunked as torch_chunked
from k3.platforms.torch_kernels import kda_rebuild as torch_rebuild
from k3.platforms.torch_kernels import kda_recurrent as torch_recurrent
from k3.reference.kda import kda_gate
from k3.reference.norms import l2_norm

F64 = torch.float64
IMPLS = {
    "reference": SimpleNamespace(recurrent=ref.kda_recurrent, chunked=ref.kda_chunked, rebuild_state=ref.kda_rebuild_state),
    "torch": SimpleNamespace(recurrent=torch_recurrent.kda_recurrent, chunked=torch_chunked.kda_chunked,
                             rebuild_state=torch_rebuild.kda_rebuild_state),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    """The KDA entries of one implementation: the naive oracle or the reference platform's."""
    return IMPLS[request.param]


def make_inputs(B, T, H, HV, K, V, *, N=None, seed=0, dtype=F64, strong=False):
    """Random KDA inputs (float64 draws cast to `dtype`; g and the state fp32 at least):
    q, k L2-normalised, g < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    if strong:  # K3's bounded gate driven hard: about half the channels decay by ~e^-5 per token
        f = torch.where(torch.arange(K) % 2 == 0, 8.0 + r(B, T, HV, K), r(B, T, HV, K) - 4.0)
        g = kda_gate(f, torch.zeros(HV, dtype=F64), lower_bound=-5.0)
    else:  # mild, with an occasional strong channel
        g = -torch.exp(r(B, T, HV, K) - 2.0)
    x = dict(
        q=l2_norm(r(B, T, H, K)).to(dtype),
        k=l2_norm(r(B, T, H, K)).to(dtype),
        v=r(B, T, HV, V).to(dtype),
        g=g.to(F64 if dtype == F64 else torch.float32),
        beta=torch.sigmoid(r(B, T, HV)).to(dtype),
    )
    state = r(N or B, HV, K, V).to(F64 if dtype == F64 else torch.float32)
    return x, state


def packed_rows(x, cu, parts):
    """Inputs restricted to rows [bos_n + a_n, bos_n + z_n) of each sequence, repacked."""
    idx = [torch.arange(int(cu[n]) + a, int(cu[n]) + z) for n, (a, z) in enumerate(parts)]
    idx = torch.cat(idx)  # [sum of part lengths] row indices into the packed T axis
    new_cu = torch.tensor([0] + [z - a for a, z in parts]).cumsum(0)
    return {name: t[:, idx] for name, t in x.items()}, new_cu


def assert_close(a, b, tol, what=""):
    err = (a.to(F64) - b.to(F64)).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.1e}"


# ---------------------------------------------------------------------------------- gate
@pytest.mark.parametrize("a_log_shape", [(1,), (1, 1, 1, 1)], ids=["A_log[HV]", "A_log[1,1,HV,1]"])
def test_gate_worked_example(a_log_shape):
    f = torch.tensor([[0.0, 1.0]])  # [HV=1, K=2]
    A_log = torch.full(a_log_shape, math.log(2.0))
    dt_bias = torch.full((2,), 0.5)
    bounded = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    soft = kda_gate(f, A_log, dt_bias)
    assert bounded.dtype == torch.float32
    assert_close(bounded, torch.tensor([[-3.6553, -4.7629]]), 1e-4, "bounded gate")
    assert_close(soft, torch.tensor([[-1.9482, -3.4028]]), 1e-4, "softplus gate")


def test_gate_shapes_dtypes_and_formulas():
    gen = torch.Generator().manual_seed(1)
    f = (4 * torch.randn(3, 5, 4, 8, generator=gen)).to(torch.bfloat16)  # [B, T, HV, K]
    A_log, dt = torch.randn(4, generator=gen), torch.randn(32, generator=gen)
    g = kda_gate(f, A_log, dt.view(4, 8), lower_bound=-5.0)
    assert g.dtype == torch.float32 and g.shape == f.shape
    assert_close(g, kda_gate(f, A_log, dt, lower_bound=-5.0), 0.0, "dt_bias [HV, K] vs [HV*K]")
    x = f.float() + dt.view(4, 8)
    a = A_log.exp()[:, None]
    assert_close(g, -5.0 * torch.sigmoid(a * x), 1e-6, "bounded")
    assert bool((g < 0).all() and (g >= -5).all())  # fp32 sigmoid saturates at -5
    g64 = kda_gate(f.double() * 10, A_log.double(), None)  # large logits: threshold-20 path
    assert g64.dtype == F64
    want = -A_log.double().exp()[:, None] * torch.nn.functional.softplus(f.double() * 10)
    assert_close(g64, want, 1e-12, "softplus")


# ------------------------------------------------------------------- worked example 3.9
@pytest.mark.parametrize("op", ["recurrent", "chunked"])
def test_worked_example_3_9(op, impl):
    q = l2_norm(torch.tensor([1.0, 1.0], dtype=F64)).view(1, 1, 1, 2)
    k = l2_norm(torch.tensor([3.0, 4.0], dtype=F64)).view(1, 1, 1, 2)
    v = torch.tensor([1.0, -1.0], dtype=F64).view(1, 1, 1, 2)
    g = torch.tensor([math.log(0.5), 0.0], dtype=F64).view(1, 1, 1, 2)
    beta = torch.sigmoid(torch.zeros(1, 1, 1, dtype=F64))
    S_vk = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=F64)  # the doc's V x K layout
    fn = impl.recurrent if op == "recurrent" else impl.chunked
    out = fn(q, k, v, g, beta, initial_state=S_vk.T.reshape(1, 1, 2, 2))
    o, S = out.o, out.state
    assert_close(o.view(2), torch.tensor([0.495, 0.09], dtype=F64), 1e-6, "o")
    new_vk = torch.tensor([[0.71, 0.28], [-0.78, 0.96]], dtype=F64)
    assert_close(S.view(2, 2), new_vk.T, 1e-6, "state (K x V = doc's transpose)")


def test_default_scale_is_inverse_sqrt_k(impl):
    x, S0 = make_inputs(1, 5, 1, 1, 16, 4, seed=2)
    o1 = impl.recurrent(**x, initial_state=S0).o
    o2 = impl.recurrent(**x, initial_state=S0, scale=16**-0.5).o
    o3 = impl.recurrent(**x, initial_state=S0, scale=1.0).o
    assert_close(o1, o2, 1e-15, "scale=None")
    assert_close(o3 * 0.25, o1, 1e-13, "scale=1")


# ------------------------------------------------------------- chunked == recurrent, fp64
EQ_CASES = [  # B, T, H, HV, K, V, cu_seqlens, chunk_size
    (2, 37, 2, 2, 8, 6, None, 16),
    (2, 37, 2, 4, 8, 6, None, 5),  # GVA
    (1, 150, 1, 2, 16, 8, [0, 5, 70, 70, 77, 150], 16),  # ragged, short and empty sequences
    (1, 150, 1, 2, 16, 8, [0, 5, 70, 70, 77, 150], 64),
    (1, 100, 2, 4, 8, 8, [0, 1, 61, 100], 1),
    (1, 100, 2, 4, 8, 8, [0, 1, 61, 100], 128),  # chunk longer than every sequence
]


def _eq_id(c):
    B, T, H, HV, K, V, cu, cs = c
    return f"B{B}_T{T}_H{H}_HV{HV}_K{K}_V{V}_" + (f"cu{len(cu) - 1}" if cu else "dense") + f"_c{cs}"


@pytest.mark.parametrize("case", EQ_CASES, ids=[_eq_id(c) for c in EQ_CASES])
@pytest.mark.parametrize("with_state", [True, False], ids=["h0", "no_h0"])
def test_chunked_equals_recurrent_fp64(case, with_state, impl):
    B, T, H, HV, K, V, cu, cs = case
    cu_t = None if cu is None else torch.tensor(cu)
    x, S0 = make_inputs(B, T, H, HV, K, V, N=None if cu is None else len(cu) - 1, seed=3)
    S0 = S0 if with_state else None
    out = impl.recurrent(
        **x, initial_state=S0, cu_seqlens=cu_t, output_per_position_states=True
    )
    o_r, s_r, states = out.o, out.state, out.states
    out = impl.chunked(**x, initial_state=S0, cu_seqlens=cu_t, chunk_size=cs)
    o_c, s_c = out.o, out.state
    N = len(cu) - 1 if cu else B
    assert o_c.shape == (B, T, HV, V) and s_c.shape == s_r.shape == (N, HV, K, V)
    assert o_c.dtype == s_c.dtype == F64 and states.shape == (B, T, HV, K, V)
    assert_close(o_c, o_r, 1e-10, "o")
    assert_close(s_c, s_r, 1e-10, "final state")
    if cu is None:
        assert_close(states[:, -1], s_r, 0.0, "last per-position state")
    if cu is not None and cu[2] == cu[3] and with_state:  # the empty sequence keeps its state
        assert_close(s_c[2], S0[2], 0.0, "empty sequence")


@pytest.mark.parametrize("case", EQ_CASES, ids=[_eq_id(c) for c in EQ_CASES])
def test_torch_kernels_equal_the_oracle_fp64(case):
    B, T, H, HV, K, V, cu, cs = case
    cu_t = None if cu is None else torch.tensor(cu)
    x, S0 = make_inputs(B, T, H, HV, K, V, N=None if cu is None else len(cu) - 1, seed=12)
    kw = dict(initial_state=S0, cu_seqlens=cu_t)
    want = ref.kda_recurrent(**x, **kw, output_per_position_states=True, output_corrections=True)
    got = torch_recurrent.kda_recurrent(**x, **kw, output_per_position_states=True, output_corrections=True)
    for name in ("o", "state", "states", "corrections"):
        assert_close(getattr(got, name), getattr(want, name), 1e-12, f"recurrent {name}")
    lens = [T] * B if cu is None else [b - a for a, b in zip(cu, cu[1:])]
    offsets = torch.tensor([[0, min(3, n), n] for n in lens])                 # [N, 3] per sequence
    chunked = torch_chunked.kda_chunked(**x, **kw, chunk_size=cs, checkpoint_offsets=offsets)
    oracle = ref.kda_chunked(**x, **kw, chunk_size=cs, checkpoint_offsets=offsets)
    for a, b in zip((chunked.o, chunked.state, *chunked.checkpoints), (oracle.o, oracle.state, *oracle.checkpoints)):
        assert_close(a, b, 1e-10, "chunked")


# -------------------------------------------------------------------------- checkpoints
CU4 = [0, 23, 87, 96, 196]  # lengths 23, 64, 9, 100
CKPT_CASES = [  # name, B, T, cu_seqlens, chunk_size, offsets (flat: shared; nested: per sequence)
    ("dense_B2_T45_c16_shared", 2, 45, None, 16, [45, 0, 16, 7, 33]),
    ("cu4_T196_c16_shared", 1, 196, CU4, 16, [0, 9, 5, 8, 9]),
    ("cu4_T196_c16_tensor", 1, 196, CU4, 16, [[0, 23, 7], [64, 17, 0], [9, 3, 1], [100, 33, 48]]),
    ("cu4_T196_c7_tensor", 1, 196, CU4, 7, [[23, 23, 7], [64, 17, 0], [9, 3, 1], [100, 99, 1]]),
]


@pytest.mark.parametrize("case", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_checkpoints(case, impl):
    _, B, T, cu, cs, offs = case
    H, HV, K, V = 1, 2, 8, 4
    N = B if cu is None else len(cu) - 1
    x, S0 = make_inputs(B, T, H, HV, K, V, N=N, seed=4)
    cu_t = None if cu is None else torch.tensor(cu)
    per_seq = isinstance(offs[0], list)
    offsets = torch.tensor(offs) if per_seq else offs
    kw = dict(initial_state=S0, cu_seqlens=cu_t)
    out = impl.chunked(**x, **kw, chunk_size=cs, checkpoint_offsets=offsets)
    o, final, ckpts = out.o, out.state, out.checkpoints
    out = impl.chunked(**x, **kw, chunk_size=cs)
    o_plain, final_plain = out.o, out.state
    assert_close(o, o_plain, 1e-12, "o with splits")
    assert_close(final, final_plain, 1e-12, "final with splits")
    states = impl.recurrent(**x, **kw, output_per_position_states=True).states
    states = states.flatten(0, 1)  # [B*T, HV, K, V]
    bos = [n * T for n in range(N)] if cu is None else cu[:-1]
    C = len(offs[0]) if per_seq else len(offs)
    assert len(ckpts) == C
    for c in range(C):
        col = [offs[n][c] if per_seq else offs[c] for n in range(N)]
        assert ckpts[c].shape == (N, HV, K, V) and ckpts[c].dtype == F64
        for n, off in enumerate(col):
            want = S0[n] if off == 0 else states[bos[n] + off - 1]
            assert_close(ckpts[c][n], want, 1e-10, f"checkpoint {c} (offset {off}) of sequence {n}")
        # and the recurrence run on the truncated sequences
        xp, cu_p = packed_rows(
            {k_: t.reshape(1, B * T, *t.shape[2:]) for k_, t in x.items()},
            torch.tensor(bos + [B * T]),
            [(0, off) for off in col],
        )
        trunc = impl.recurrent(**xp, initial_state=S0, cu_seqlens=cu_p).state
        assert_close(ckpts[c], trunc, 1e-10, f"checkpoint {c} vs truncated recurrence")


# ----------------------------------------------------------------- split calls, decode steps
@pytest.mark.parametrize("op", ["recurrent", "chunked"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense_B3_T40", "cu3_T90"])
def test_split_calls_equal_one_call(op, packed, impl):
    fn = impl.recurrent if op == "recurrent" else partial(impl.chunked, chunk_size=8)
    H, HV, K, V = 1, 2, 8, 4
    if packed:
        cu = torch.tensor([0, 12, 50, 90])
        x, S0 = make_inputs(1, 90, H, HV, K, V, N=3, seed=5)
        first = [(0, 5), (0, 0), (0, 17)]  # per-sequence split points 5, 0, 17
        second = [(z, int(cu[n + 1] - cu[n])) for n, (_, z) in enumerate(first)]
        x1, cu1 = packed_rows(x, cu, first)
        x2, cu2 = packed_rows(x, cu, second)
        out = fn(**x, initial_state=S0, cu_seqlens=cu)
        o, s = out.o, out.state
        out = fn(**x1, initial_state=S0, cu_seqlens=cu1)
        o1, s1 = out.o, out.state
        out = fn(**x2, initial_state=s1, cu_seqlens=cu2)
        o2, s2 = out.o, out.state
        assert_close(o1, packed_rows({"o": o}, cu, first)[0]["o"], 1e-12, "o, first call")
        assert_close(o2, packed_rows({"o": o}, cu, second)[0]["o"], 1e-12, "o, second call")
    else:
        x, S0 = make_inputs(3, 40, H, HV, K, V, seed=5)
        out = fn(**x, initial_state=S0)
        o, s = out.o, out.state
        out = fn(**{k_: t[:, :13] for k_, t in x.items()}, initial_state=S0)
        o1, s1 = out.o, out.state
        out = fn(**{k_: t[:, 13:] for k_, t in x.items()}, initial_state=s1)
        o2, s2 = out.o, out.state
        assert_close(torch.cat([o1, o2], 1), o, 1e-12, "o")
    assert_close(s2, s, 1e-12, "final state")


def test_decode_steps_equal_prefill(impl):
    x, S0 = make_inputs(2, 12, 2, 4, 8, 8, seed=6)
    out = impl.recurrent(**x, initial_state=S0)
    o, s = out.o, out.state
    state, outs = S0, []
    for t in range(12):
        step = {name: v[:, t : t + 1] for name, v in x.items()}  # T = 1
        out = impl.recurrent(**step, initial_state=state)
        o_t, state = out.o, out.state
        outs.append(o_t)
    assert_close(torch.cat(outs, 1), o, 1e-12, "o")
    assert_close(state, s, 1e-12, "state")


# --------------------------------------------------------------------------- precision
def test_strong_decay_long_chunks_fp32_finite(impl):
    x, S0 = make_inputs(1, 256, 1, 2, 16, 8, seed=7, strong=True)
    assert float(x["g"].min()) < -4.9
    x32 = {k_: v.float() for k_, v in x.items()}
    out = impl.recurrent(**x, initial_state=S0)
    o_ref, s_ref = out.o, out.state
    for cs in (64, 256):
        kw = dict(initial_state=S0.float(), chunk_size=cs, checkpoint_offsets=[9])
        out = impl.chunked(**x32, **kw)
        o, s = out.o, out.state
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert o.dtype == s.dtype == torch.float32
        assert_close(o, o_ref, 1e-5, f"fp32 o, chunk {cs}")
        assert_close(s, s_ref, 1e-5, f"fp32 state, chunk {cs}")


@pytest.mark.parametrize("op", ["recurrent", "chunked"])
def test_bf16_inputs(op, impl):
    """bf16 q/k/v/beta, fp32 g and state: o is bf16 and within 2^-8 * max(1, max|o|) (half a
    bf16 ulp at 1) of float64 run on the same bf16-rounded inputs; the fp32 state within 1e-5."""
    x, S0 = make_inputs(2, 50, 2, 4, 16, 16, seed=8, dtype=torch.bfloat16)
    fn = impl.recurrent if op == "recurrent" else impl.chunked
    cu = torch.tensor([0, 30, 100])
    for cu_t, xx in ((None, x), (cu, {k_: v.reshape(1, 100, *v.shape[2:]) for k_, v in x.items()})):
        out = fn(**xx, initial_state=S0, cu_seqlens=cu_t)
        o, s = out.o, out.state
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        x64 = {name: v.double() for name, v in xx.items()}
        out = impl.recurrent(**x64, initial_state=S0.double(), cu_seqlens=cu_t)
        o64, s64 = out.o, out.state
        assert_close(o, o64, 2**-8 * max(1.0, float(o64.abs().max())), "bf16 o")
        assert_close(s, s64, 1e-5, "fp32 state")


# ------------------------------------------------------------------------------- errors
def _replace(**changes):  # mutation of the valid B=2, T=6, H=2, HV=4, K=8, V=4 inputs
    return lambda x, kw: ({**x, **{n: c(x) for n, c in changes.items() if n in x}},
                          {**kw, **{n: c(kw) for n, c in changes.items() if n not in x}})


BAD = [  # name, mutation, expected message
    ("k", _replace(k=lambda x: x["k"][..., :4]), r"k must be \[B, T, H, K\]"),
    ("v", _replace(v=lambda x: x["v"][:, :, :3]), r"v must be \[B, T, HV, V\].*multiple of H=2"),
    ("g", _replace(g=lambda x: x["g"][:, :, :2]), r"g must be \[B, T, HV, K\] = \[2, 6, 4, 8\]"),
    ("beta", _replace(beta=lambda x: x["beta"][..., None]),
     r"beta must be \[B, T, HV\] = \[2, 6, 4\]"),
    ("initial_state", _replace(initial_state=lambda kw: kw["initial_state"][:, :, :4]),
     r"initial_state must be \[N, HV, K, V\] = \[2, 4, 8, 4\]"),
    ("cu_B", _replace(cu_seqlens=lambda kw: torch.tensor([0, 3, 6])), r"B must be 1"),
]


@pytest.mark.parametrize("op", ["recurrent", "chunked"])
@pytest.mark.parametrize("name,mutate,match", BAD, ids=[b[0] for b in BAD])
def test_bad_shapes_raise(op, name, mutate, match, impl):
    x, S0 = make_inputs(2, 6, 2, 4, 8, 4, seed=9)
    x, kw = mutate(x, dict(initial_state=S0))
    with pytest.raises(ValueError, match=match):
        (impl.recurrent if op == "recurrent" else impl.chunked)(**x, **kw)


def test_bad_options_raise(impl):
    x, S0 = make_inputs(1, 10, 1, 1, 4, 4, N=2, seed=10)
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match=r"checkpoint offset 5 of sequence 0 .*\[0, 4\]"):
        impl.chunked(**x, cu_seqlens=cu, checkpoint_offsets=[0, 5])
    with pytest.raises(ValueError, match=r"checkpoint offset 7 of sequence 1 .*\[0, 6\]"):
        impl.chunked(**x, cu_seqlens=cu, checkpoint_offsets=torch.tensor([[1], [7]]))
    with pytest.raises(ValueError, match=r"checkpoint_offsets tensor must be \[N=2, C\]"):
        impl.chunked(**x, cu_seqlens=cu, checkpoint_offsets=torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0.*end at T=10"):
        impl.recurrent(**x, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        impl.chunked(**x, cu_seqlens=cu, chunk_size=0)
    f = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match=r"A_log must be \[HV\] = \[2\]"):
        kda_gate(f, torch.zeros(4))
    with pytest.raises(ValueError, match=r"dt_bias must be \[HV\*K\] = \[8\] or \[HV, K\]"):
        kda_gate(f, torch.zeros(2), torch.zeros(4, 2))
    for lb in (-6.0, 0.0):
        with pytest.raises(ValueError, match=r"lower_bound must be in \[-5, 0\)"):
            kda_gate(f, torch.zeros(2), lower_bound=lb)


def test_rebuild_state_from_corrections_equals_per_position_states(impl):
    """RecoverSSM-style rollback: the closed-form rebuild from recorded corrections equals the
    recurrence's per-position states at every kept length (0 = the initial state)."""
    g_ = torch.Generator().manual_seed(11)
    n, length, h, hv, d = 3, 6, 2, 4, 8
    q = l2_norm(torch.randn(n, length, h, d, generator=g_, dtype=torch.float64))
    k = l2_norm(torch.randn(n, length, h, d, generator=g_, dtype=torch.float64))
    v = torch.randn(n, length, hv, d, generator=g_, dtype=torch.float64)
    g = -5 * torch.rand(n, length, hv, d, generator=g_, dtype=torch.float64)
    beta = torch.rand(n, length, hv, generator=g_, dtype=torch.float64)
    s0 = torch.randn(n, hv, d, d, generator=g_, dtype=torch.float64)
    out = impl.recurrent(q, k, v, g, beta, initial_state=s0, output_per_position_states=True,
                        output_corrections=True)
    final, states, u = out.state, out.states, out.corrections
    k_hv = k.repeat_interleave(hv // h, dim=2)
    for kept in ([0, 0, 0], [1, 3, 6], [6, 2, 4]):
        rebuilt = impl.rebuild_state(s0, k_hv, g, u, torch.tensor(kept))
        for i, m in enumerate(kept):
            expected = s0[i] if m == 0 else states[i, m - 1]
            torch.testing.assert_close(rebuilt[i], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(impl.rebuild_state(s0, k_hv, g, u, torch.full((n,), length)), final, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("zero_row", [False, True])
def test_prepared_inputs_rows_heads_scale_and_zero_row(dtype, zero_row):
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V = 2, 5, 2, 4, 8, 6
    q, k = (torch.randn(B, T, H, K, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, HV, K, generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, generator=gen).to(dtype)
    p = prepare_kda_inputs("kda_chunked", q, k, v, g, beta, 0.5, None, None, zero_row=zero_row)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    rows = B * T + (1 if zero_row else 0)
    want_q = q.to(cd).repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K) * 0.5
    want_k = k.to(cd).repeat_interleave(HV // H, dim=2).reshape(B * T, HV, K)
    for got, want in ((p.q, want_q), (p.k, want_k), (p.v, v.to(cd).reshape(B * T, HV, V)),
                      (p.g, g.to(cd).reshape(B * T, HV, K)), (p.beta, beta.to(cd).reshape(B * T, HV))):
        assert got.dtype == cd and got.shape[0] == rows
        torch.testing.assert_close(got[: B * T], want, rtol=0, atol=0)
        if zero_row:
            assert (got[-1] == 0).all()
