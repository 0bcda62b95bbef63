"""variants.kda (family variants, issue 32; see cases/variants.py): the paths a KDA layer takes for
a sequence's tokens, which the step kind and the batch pick, must round at the same points.

Three probe sequences of T tokens each, from random fp32 states and conv windows, through:
  - decode: `kda.decode_step`, one fused step a token over the cache's state rows (in the
    platform's state layout): the reference every other path is compared with;
  - one_token_steps: `kda.short_conv` (B = N, T = 1) + the L2 norms + `kda.gate` +
    `kda.recurrent` (T = 1) + `elementwise.gated_rms_norm`, a token at a time: the decode of a
    batch in which a sequence saves a prefix-cache checkpoint;
  - prefill_alone / prefill_packed: `kda.short_conv` and `kda.chunked` over each probe's tokens
    as one chunk, then over all probes packed with two other sequences (5 and 70 tokens: a
    70-token one crosses a 64-token chunk);
  - verify: `kda.recurrent` with per-position states over the packed probes (speculative verify).
The layer's outputs (after the gated norm) and the final recurrent states must agree with the
decode path's at the rounding points of the model's dtype (`compare.variants_agree`; the states
are fp32 but computed from q, k and v rounded to that dtype, so its bound applies), and the conv
windows must be the decode path's exactly (they hold raw inputs).
"""

from __future__ import annotations

import math

import torch

from .. import compare as cmp
from ..inputs import TORCH_DTYPES, cu_seqlens, poisoned, randn, state_dtype, uniform
from ..registry import Case, Sample, register
from .variants import DTYPES, _call

EPS = 1e-5


class _Layer:
    """The random weights and per-token inputs of one KDA layer, and the unfused composition the
    model runs (KDAMixer._recur) through the platform's kernels."""

    def __init__(self, g, dtype, *, heads, head_dim, width, lower_bound):
        h, k = heads, head_dim
        sd = state_dtype(dtype)
        self.dtype, self.h, self.k, self.w, self.lower_bound = dtype, h, k, width, lower_bound
        self.conv_w = randn(g, (3 * h * k, width), dtype, 0.5)
        self.a_log = uniform(g, (h,), 0.0, math.log(16), sd)
        self.dt_bias = randn(g, (h, k), sd, 0.5)
        self.o_norm = randn(g, (k,), dtype, 0.3, 1.0)

    def to(self, device) -> "_Layer":
        for name in ("conv_w", "a_log", "dt_bias", "o_norm"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def tokens(self, g, t):
        """(qkv [T, 3HK], f [T, H, K], b [T, H], out_gate [T, H, K]) of t tokens."""
        h, k, dt = self.h, self.k, self.dtype
        return randn(g, (t, 3 * h * k), dt), randn(g, (t, h, k), dt), randn(g, (t, h), dt), randn(g, (t, h, k), dt)

    def heads(self, kernels, y):
        q, kk, v = y.reshape(-1, 3, self.h, self.k).unbind(1)
        return kernels.elementwise.l2_norm(q), kernels.elementwise.l2_norm(kk), v

    def unfused(self, kernels, qkv, f, b, gate, window, s0, *, decode, cu=None, chunked=False):
        """The layer before o_proj on the unfused path: (out [T, H, V], state, window). decode: N
        one-token sequences (B = N); else the tokens packed with cu_seqlens."""
        x = qkv.unsqueeze(1) if decode else qkv.unsqueeze(0)
        conv = kernels.kda.short_conv(x, self.conv_w, conv_state=window, **({} if decode else {"cu_seqlens": cu}))
        q, kk, v = self.heads(kernels, conv.y)
        g = kernels.kda.gate(f, self.a_log, self.dt_bias, lower_bound=self.lower_bound)
        beta = torch.sigmoid(b.to(g.dtype))
        shape = (qkv.shape[0], 1) if decode else (1, qkv.shape[0])
        args = tuple(z.reshape(*shape, *z.shape[1:]) for z in (q, kk, v, g, beta))
        varlen = {} if decode else {"cu_seqlens": cu}
        if chunked:
            out = kernels.kda.chunked(*args, initial_state=s0, **varlen)
        else:
            out = kernels.kda.recurrent(*args, initial_state=s0, output_per_position_states=not decode, **varlen)
        o = out.o.reshape(qkv.shape[0], self.h, self.k)
        return kernels.elementwise.gated_rms_norm(o, gate, self.o_norm, EPS), out.state, conv.state


def _kda_paths(ctx, item):
    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    g = torch.Generator().manual_seed(item.seed)
    n, t = 3, p["tokens"]
    layer = _Layer(g, dtype, heads=p["heads"], head_dim=p["head_dim"], width=4, lower_bound=-5.0)
    h, k, c = layer.h, layer.k, 3 * layer.h * layer.k
    sd = state_dtype(dtype)
    s0 = randn(g, (n, h, k, k), sd, 0.1)
    win0 = randn(g, (n, c, layer.w - 1), dtype)
    qkv, f, b, gate = (x.view(n, t, *x.shape[1:]) for x in layer.tokens(g, n * t))   # [N, T, ...]
    kernels = ctx.platform.kernels
    layer.to(ctx.device)

    # decode: the fused step over poisoned state rows (rows 1, 3, 5 of 7) in the platform's layout
    rows = torch.tensor([1, 3, 5])
    layout = ctx.platform.kda_state_layout
    stored = poisoned((7, h, k, k), sd).to(ctx.device)
    recurrent = stored if layout == "hkv" else stored.transpose(-1, -2).contiguous().transpose(-1, -2)
    recurrent[rows.to(ctx.device)] = s0.to(ctx.device)
    window = poisoned((7, c, layer.w - 1), dtype).to(ctx.device)
    window[rows.to(ctx.device)] = win0.to(ctx.device)
    fresh = torch.zeros(n, dtype=torch.bool)
    decode = torch.stack([_call(ctx, kernels.kda.decode_step, qkv[:, j], layer.conv_w, f[:, j], layer.a_log,
                                layer.dt_bias, b[:, j], gate[:, j], layer.o_norm, recurrent, window, rows, fresh,
                                lower_bound=layer.lower_bound, norm_eps=EPS) for j in range(t)], 1)   # [N, T, H, V]
    want = {"out": decode, "state": recurrent[rows.to(ctx.device)].cpu(), "window": window[rows.to(ctx.device)].cpu()}

    def check(name, out, state, win):
        return [cmp.variants_agree(f"{name}_out", out, want["out"]),
                cmp.variants_agree(f"{name}_state", state, want["state"], rounding=dtype),
                cmp.exact(f"{name}_window", win, want["window"])]

    outcome = cmp.Outcome()
    # one-token steps of the unfused path
    state, win, outs = s0, win0, []
    for j in range(t):
        o, state, win = _call(ctx, layer.unfused, kernels, qkv[:, j], f[:, j], b[:, j], gate[:, j], win, state,
                              decode=True)
        outs.append(o)
    outcome.outputs += check("one_token_steps", torch.stack(outs, 1), state, win)
    # chunked prefill of each probe alone, then of all probes packed with two other sequences
    alone = [_call(ctx, layer.unfused, kernels, qkv[i], f[i], b[i], gate[i], win0[i: i + 1], s0[i: i + 1],
                   decode=False, cu=cu_seqlens([t]), chunked=True) for i in range(n)]
    outcome.outputs += check("prefill_alone", torch.stack([a[0] for a in alone]), torch.cat([a[1] for a in alone]),
                             torch.cat([a[2] for a in alone]))
    extra = [5, 70]
    xo, fo, bo, go = layer.tokens(g, sum(extra))
    lens = [extra[0], t, t, t, extra[1]]                  # the probes between the other two
    cut = [0, *torch.tensor(lens).cumsum(0).tolist()]

    def packed(probe, other):
        return torch.cat([other[: extra[0]], probe.flatten(0, 1), other[extra[0]:]])

    s_all = torch.cat([randn(g, (1, h, k, k), sd, 0.1), s0, randn(g, (1, h, k, k), sd, 0.1)])
    w_all = torch.cat([randn(g, (1, c, layer.w - 1), dtype), win0, randn(g, (1, c, layer.w - 1), dtype)])
    inputs = (packed(qkv, xo), packed(f, fo), packed(b, bo), packed(gate, go))
    for name, chunked in (("prefill_packed", True), ("verify", False)):
        o, state, win = _call(ctx, layer.unfused, kernels, *inputs, w_all, s_all, decode=False, cu=cu_seqlens(lens),
                              chunked=chunked)
        probe_out = torch.stack([o[cut[i]: cut[i + 1]] for i in (1, 2, 3)])
        outcome.outputs += check(name, probe_out, state[1:4], win[1:4])
    return outcome


register(Case(
    "variants.kda", "variants", "variants.kda", run=_kda_paths, dtypes=DTYPES, smoke_dtype="bfloat16",
    samples=(
        Sample("N3_T12_H2_K16", params={"tokens": 12, "heads": 2, "head_dim": 16}),
        Sample("N3_T9_H2_K128_real_head_dim", params={"tokens": 9, "heads": 2, "head_dim": 128}),
    ),
    doc="A KDA layer's tokens through the fused decode step, one-token unfused steps, chunked prefill "
        "(alone and packed) and the verify recurrence agree at the rounding points."))
