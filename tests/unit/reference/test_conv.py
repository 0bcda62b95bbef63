"""Depthwise causal short conv (KDA q/k/v conv) with cached history and checkpoints, on both
implementations: the naive oracle (k3.reference) and the torch kernel the reference platform
serves (k3.platforms.torch_kernels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from k3 import reference as ref
from k3.platforms.torch_kernels import short_conv as torch_conv

F64 = torch.float64
IMPLS = {"reference": SimpleNamespace(short_conv=ref.short_conv), "torch": SimpleNamespace(short_conv=torch_conv.short_conv)}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def rand(*shape, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def conv1d_oracle(x, w, state, activation):
    """torch conv1d over [state, x] (left padding = the history), x [B, T, C], state [B, C, W-1]."""
    xp = torch.cat([state, x.transpose(1, 2)], dim=2)  # [B, C, W-1+T]
    y = F.conv1d(xp, w.view(w.shape[0], 1, -1), groups=w.shape[0]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def assert_close(a, b, tol, what=""):
    err = (a.to(F64) - b.to(F64)).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3e} > {tol:.1e}"


CASES = [(2, 9, 6, 4), (3, 2, 5, 4), (1, 17, 8, 2), (2, 5, 3, 1)]  # B, T, C, W


@pytest.mark.parametrize("B,T,C,W", CASES, ids=[f"B{b}_T{t}_C{c}_W{w}" for b, t, c, w in CASES])
@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "noact"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "state"])
def test_matches_conv1d(B, T, C, W, activation, with_state, impl):
    x, w = rand(B, T, C, seed=1), rand(C, W, seed=2)
    state = rand(B, C, W - 1, seed=3) if with_state else None
    conv = impl.short_conv(x, w.view(C, 1, W), conv_state=state, activation=activation)
    y, final = conv.y, conv.state
    ref_state = torch.zeros(B, C, W - 1, dtype=F64) if state is None else state
    assert y.shape == x.shape and final.shape == (B, C, W - 1)
    assert_close(y, conv1d_oracle(x, w, ref_state, activation), 1e-12, "y")
    want = torch.cat([ref_state, x.transpose(1, 2)], 2)[:, :, T:]  # last W-1 inputs, oldest first
    assert_close(final, want, 0.0, "final state")
    y2 = impl.short_conv(x, w, conv_state=state, activation=activation).y  # [C, W] weight
    assert_close(y2, y, 0.0, "weight [C, W]")


def test_packed_ragged_with_short_sequence(impl):
    """cu_seqlens with lengths 2 < W-1 = 3, 0, 7, 1: each sequence == its own dense call."""
    C, W = 5, 4
    lens = [2, 0, 7, 1]
    cu = torch.tensor([0, *lens]).cumsum(0)
    x, w, state = rand(1, sum(lens), C, seed=4), rand(C, W, seed=5), rand(4, C, W - 1, seed=6)
    conv = impl.short_conv(x, w, conv_state=state, cu_seqlens=cu)
    y, final = conv.y, conv.state
    for n, length in enumerate(lens):
        xs = x[:, cu[n] : cu[n + 1]]
        conv = impl.short_conv(xs, w, conv_state=state[n : n + 1])
        yn, fn = conv.y, conv.state
        assert_close(y[:, cu[n] : cu[n + 1]], yn, 1e-12, f"y of sequence {n}")
        assert_close(final[n], fn[0], 0.0, f"state of sequence {n}")
    assert_close(final[0], torch.cat([state[0, :, 2:], x[0, :2].T], 1), 0.0, "short keeps old")
    assert_close(final[1], state[1], 0.0, "empty sequence keeps its state")


@pytest.mark.parametrize("packed", [False, True], ids=["dense_B2_T11_C6", "cu2_T11_C6"])
def test_split_calls_and_decode_steps(packed, impl):
    C, W = 6, 4
    x, w, state = rand(2, 11, C, seed=7), rand(C, W, seed=8), rand(2, C, W - 1, seed=9)
    conv = impl.short_conv(x, w, conv_state=state)
    y, final = conv.y, conv.state
    if packed:  # two sequences packed: the first call takes 4 and 1 tokens, the second the rest
        x1 = torch.cat([x[0, :4], x[1, :1]])[None]
        x2 = torch.cat([x[0, 4:], x[1, 1:]])[None]
        conv = impl.short_conv(x1, w, conv_state=state, cu_seqlens=torch.tensor([0, 4, 5]))
        y1, s1 = conv.y, conv.state
        conv = impl.short_conv(x2, w, conv_state=s1, cu_seqlens=torch.tensor([0, 7, 17]))
        y2, s2 = conv.y, conv.state
        assert_close(torch.cat([y1[0, :4], y2[0, :7]]), y[0], 1e-12, "y seq 0")
        assert_close(torch.cat([y1[0, 4:], y2[0, 7:]]), y[1], 1e-12, "y seq 1")
    else:
        conv = impl.short_conv(x[:, :3], w, conv_state=state)
        y1, s1 = conv.y, conv.state
        conv = impl.short_conv(x[:, 3:], w, conv_state=s1)
        y2, s2 = conv.y, conv.state
        assert_close(torch.cat([y1, y2], 1), y, 1e-12, "y")
    assert_close(s2, final, 0.0, "final state")
    s, outs = state, []  # decode: T = 1 repeatedly == one prefill
    for t in range(11):
        if packed:
            conv = impl.short_conv(x[:, t][None], w, conv_state=s, cu_seqlens=torch.tensor([0, 1, 2]))
            y_t, s = conv.y, conv.state
            outs.append(y_t[0][:, None])
        else:
            conv = impl.short_conv(x[:, t : t + 1], w, conv_state=s)
            y_t, s = conv.y, conv.state
            outs.append(y_t)
    assert_close(torch.cat(outs, 1), y, 1e-12, "decode y")
    assert_close(s, final, 0.0, "decode state")


CKPT = [  # name, lengths (None: dense B=3, T=9), offsets (flat: shared; nested: per sequence)
    ("cu3_T25_shared", [9, 2, 14], [2, 0, 1]),
    ("cu3_T25_tensor", [9, 2, 14], [[9, 0, 5, 1], [1, 2, 0, 2], [14, 13, 3, 0]]),
    ("dense_B3_T9_shared", None, [9, 0, 4, 2]),
    ("dense_B3_T9_tensor", None, [[9, 0], [1, 8], [5, 5]]),
]


@pytest.mark.parametrize("name,lens,offs", CKPT, ids=[c[0] for c in CKPT])
def test_checkpoints(name, lens, offs, impl):
    C, W = 4, 4
    per_seq = isinstance(offs[0], list)
    cu = torch.tensor([0, *(lens or [9, 9, 9])]).cumsum(0)
    x = rand(1, int(cu[-1]), C, seed=10)  # packed rows; sequence n is x[:, cu[n]:cu[n+1]]
    x_in, cu_arg = (x, cu) if lens else (x.view(3, 9, C), None)
    w, state = rand(C, W, seed=11), rand(3, C, W - 1, seed=12)
    conv = impl.short_conv(x_in, w, conv_state=state, cu_seqlens=cu_arg)
    y0, f0 = conv.y, conv.state
    conv = impl.short_conv(
        x_in, w, conv_state=state, cu_seqlens=cu_arg,
        checkpoint_offsets=torch.tensor(offs) if per_seq else offs,
    )
    y, final, ckpts = conv.y, conv.state, conv.checkpoints
    assert_close(y, y0, 1e-12, "y")
    assert_close(final, f0, 0.0, "final")
    assert len(ckpts) == len(offs[0] if per_seq else offs)
    for c, ck in enumerate(ckpts):
        assert ck.shape == (3, C, W - 1) and ck.dtype == x.dtype
        for n in range(3):
            off = offs[n][c] if per_seq else offs[c]
            want = impl.short_conv(x[:, cu[n] : cu[n] + off], w, conv_state=state[n : n + 1]).state
            assert_close(ck[n], want[0], 0.0, f"checkpoint {c} (offset {off}) of sequence {n}")


def test_bf16(impl):
    """bf16 x and state, fp32 weight: y and state bf16, y within 2^-8 * max(1, max|y|) of
    float64 on the same inputs."""
    x = rand(2, 10, 16, seed=13, dtype=torch.bfloat16)
    w = rand(16, 4, seed=14).float()
    state = rand(2, 16, 3, seed=15, dtype=torch.bfloat16)
    conv = impl.short_conv(x, w, conv_state=state)
    y, final = conv.y, conv.state
    assert y.dtype == final.dtype == torch.bfloat16
    ref = conv1d_oracle(x.double(), w.double(), state.double(), "silu")
    assert_close(y, ref, 2**-8 * max(1.0, float(ref.abs().max())), "bf16 y")
    assert_close(final, torch.cat([state, x.transpose(1, 2)], 2)[:, :, -3:], 0.0, "state")


BAD = [
    (dict(x=torch.randn(2, 3)), r"x must be a float tensor \[B, T, C\]"),
    (dict(weight=torch.randn(5, 4)), r"weight must be \[C, W\] or \[C, 1, W\] with C=4"),
    (dict(conv_state=torch.randn(2, 4, 4)), r"conv_state must be \[N, C, W-1\] = \[2, 4, 3\]"),
    (dict(cu_seqlens=torch.tensor([0, 3])), r"B must be 1"),
    (dict(activation="gelu"), r"activation must be 'silu' or None"),
    (dict(checkpoint_offsets=[0, 6]), r"checkpoint offset 6 of sequence 0 is outside \[0, 5\]"),
    (dict(checkpoint_offsets=torch.tensor([[1, 2]])), r"offsets tensor must be \[N=2, C\]"),
]


BAD_IDS = [f"{next(iter(b))}{i}" for i, (b, _) in enumerate(BAD)]


@pytest.mark.parametrize("bad,match", BAD, ids=BAD_IDS)
def test_bad_arguments_raise(bad, match, impl):
    kw = dict(x=torch.randn(2, 5, 4), weight=torch.randn(4, 1, 4))
    kw.update(bad)
    x = kw.pop("x")
    with pytest.raises(ValueError, match=match):
        impl.short_conv(x, kw.pop("weight"), **kw)
