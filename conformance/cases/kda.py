"""Kimi Delta Attention (`KDAKernels`): gate, short_conv, chunked, recurrent, rebuild_state and
the fused decode step over state rows.

Inputs follow the model: q, k, v (and conv inputs) in the activation dtype, gates, beta and
states in fp32 (fp64 for float64). Samples cover ragged varlen batches with a length-1 sequence,
GVA (HV > H), initial states, the decode layout (N sequences as B = N, T = 1, no cu_seqlens),
per-position states (speculative verify), checkpoints at arbitrary offsets, K3's real head dim.
"""

from __future__ import annotations

import math

import torch

from k3 import reference as ref

from ..inputs import TORCH_DTYPES, Inputs, cu_seqlens, l2_normalised, randn, state_dtype, uniform
from ..registry import Case, Sample, register, tolerances


def _gate(shape, *, lower_bound, dt_shape, legacy=False, scale=2.0):
    def make(g, dtype):
        hv, k = shape[-2:]
        sd = state_dtype(dtype)
        a_log = uniform(g, (hv,), 0.0, math.log(16), sd)
        dt_bias = None if dt_shape is None else randn(g, dt_shape, sd, 0.5)
        return Inputs((randn(g, shape, dtype, scale), a_log.reshape(1, 1, hv, 1) if legacy else a_log, dt_bias),
                      {"lower_bound": lower_bound})
    return make


register(Case(
    "kda.gate", "kda", "kda.gate", reference=ref.kda_gate,
    samples=(
        Sample("T37_HV4_K16_k3_bounded", _gate((37, 4, 16), lower_bound=-5.0, dt_shape=(4, 16))),
        Sample("B2_T9_HV3_K32_softplus_flat_dt_bias", _gate((2, 9, 3, 32), lower_bound=None, dt_shape=(96,))),
        Sample("T5_HV2_K128_legacy_A_log_no_dt_bias", _gate((5, 2, 128), lower_bound=-2.5, dt_shape=None,
                                                              legacy=True)),
        Sample("T11_HV2_K16_softplus_past_threshold", _gate((11, 2, 16), lower_bound=None, dt_shape=(2, 16),
                                                            scale=15.0)),
    ),
    doc="Per-channel log decay g <= 0 (K3 bounded sigmoid, Kimi-Linear softplus), in fp32."))


def _conv(*, lens=None, batch=None, channels, width, state=True, activation="silu", conv3d=False,
          offsets=None):
    def make(g, dtype):
        n = len(lens) if lens else batch[0]
        x = randn(g, (1, sum(lens), channels) if lens else (*batch, channels), dtype)
        w = randn(g, (channels, 1, width) if conv3d else (channels, width), dtype, 0.5)
        kw = {"activation": activation}
        if state:
            kw["conv_state"] = randn(g, (n, channels, width - 1), dtype)
        if lens:
            kw["cu_seqlens"] = cu_seqlens(lens)
        if offsets is not None:
            kw["checkpoint_offsets"] = torch.tensor(offsets, dtype=torch.int64)
        return Inputs((x, w), kw)
    return make


def _with_checkpoints(first: str):
    """outputs() of a `ShortConvOut` / `KDAChunkedOut`: the output, the final state, then each
    checkpoint as checkpoint{i}."""
    def outputs(result, args, kwargs):
        out = {first: getattr(result, first), "final_state": result.state}
        out.update({f"checkpoint{i}": c for i, c in enumerate(result.checkpoints)})
        return out
    return outputs


register(Case(
    "kda.short_conv", "kda", "kda.short_conv", reference=ref.short_conv,
    outputs=_with_checkpoints("y"),
    samples=(
        Sample("ragged4_T26_C96_W4_state_len1_seq", _conv(lens=(5, 1, 17, 3), channels=96, width=4)),
        Sample("decode_N3_T1_C192_W4", _conv(batch=(3, 1), channels=192, width=4)),
        Sample("B2_T9_C64_W3_no_state_no_act_conv1d_weight", _conv(batch=(2, 9), channels=64, width=3,
                                                                    state=False, activation=None, conv3d=True)),
        Sample("ragged2_T30_C48_W4_checkpoints", _conv(lens=(13, 17), channels=48, width=4,
                                                        offsets=[[0, 4, 13], [2, 2, 17]])),
    ),
    doc="Depthwise causal conv with cached history; final windows and checkpoint windows."))


def _kda(*, lens=None, batch=None, h, hv, k, v, init=True, chunk=None, offsets=None, scale=None,
         per_position=False, corrections=False, decay_shift=0.0):
    def make(g, dtype):
        shape = (1, sum(lens)) if lens else batch
        n = len(lens) if lens else batch[0]
        sd = state_dtype(dtype)
        gate = -5.0 * torch.sigmoid(torch.randn((*shape, hv, k), generator=g, dtype=torch.float64) * 1.5
                                    + decay_shift)
        args = (l2_normalised(g, (*shape, h, k), dtype), l2_normalised(g, (*shape, h, k), dtype),
                randn(g, (*shape, hv, v), dtype), gate.to(sd),
                torch.sigmoid(torch.randn((*shape, hv), generator=g, dtype=torch.float64)).to(sd))
        kw = {}
        if init:
            kw["initial_state"] = randn(g, (n, hv, k, v), sd, 0.5)
        if lens:
            kw["cu_seqlens"] = cu_seqlens(lens)
        if chunk is not None:
            kw["chunk_size"] = chunk
        if offsets is not None:
            kw["checkpoint_offsets"] = torch.tensor(offsets, dtype=torch.int64)
        if scale is not None:
            kw["scale"] = scale
        if per_position:
            kw["output_per_position_states"] = True
        if corrections:
            kw["output_corrections"] = True
        return Inputs(args, kw)
    return make


register(Case(
    "kda.chunked", "kda", "kda.chunked", reference=ref.kda_chunked,
    outputs=_with_checkpoints("o"),
    samples=(
        Sample("ragged3_T101_H2_HV4_K16_V32_chunk16_init",
               _kda(lens=(37, 1, 63), h=2, hv=4, k=16, v=32, chunk=16)),
        Sample("B2_T40_H2_HV2_K32_V16_no_state", _kda(batch=(2, 40), h=2, hv=2, k=32, v=16, init=False)),
        Sample("ragged2_T80_H2_HV2_K128_V128_init", _kda(lens=(50, 30), h=2, hv=2, k=128, v=128)),
        Sample("ragged3_T300_H2_HV4_K128_V128_init_multi_chunk",
               _kda(lens=(130, 1, 169), h=2, hv=4, k=128, v=128, decay_shift=-2.0)),
        Sample("ragged2_T30_H1_HV2_K16_V16_chunk8_checkpoints",
               _kda(lens=(13, 17), h=1, hv=2, k=16, v=16, chunk=8, offsets=[[0, 5, 13], [3, 3, 17]])),
        Sample("B1_T70_H1_HV1_K64_V64_chunk32_scale0.3_slow_decay",
               _kda(batch=(1, 70), h=1, hv=1, k=64, v=64, chunk=32, scale=0.3, decay_shift=-3.0)),
    ),
    doc="Chunked (WY/UT) KDA from initial states; outputs, final states and checkpoint states."))

def _recurrent_outputs(result, args, kwargs):
    """A `KDARecurrentOut`: o, final_state, and states and corrections when they were asked for."""
    out = {"o": result.o, "final_state": result.state}
    if kwargs.get("output_per_position_states"):
        out["states"] = result.states
    if kwargs.get("output_corrections"):
        out["corrections"] = result.corrections
    return out


register(Case(
    "kda.recurrent", "kda", "kda.recurrent", reference=ref.kda_recurrent,
    outputs=_recurrent_outputs,
    samples=(
        Sample("decode_N3_T1_H2_HV4_K16_V32", _kda(batch=(3, 1), h=2, hv=4, k=16, v=32)),
        Sample("ragged3_T12_H2_HV4_K16_V32_init", _kda(lens=(5, 1, 6), h=2, hv=4, k=16, v=32)),
        Sample("ragged2_T9_H2_HV2_K128_V128_per_position",
               _kda(lens=(4, 5), h=2, hv=2, k=128, v=128, per_position=True)),
        Sample("B2_T3_H1_HV2_K32_V16_per_position_no_state",
               _kda(batch=(2, 3), h=1, hv=2, k=32, v=16, init=False, per_position=True)),
        Sample("verify_ragged3_T10_H2_HV2_K128_V128_states_corrections",
               _kda(lens=(4, 2, 4), h=2, hv=2, k=128, v=128, per_position=True, corrections=True)),
        Sample("ragged2_T7_H1_HV2_K16_V32_corrections_only", _kda(lens=(3, 4), h=1, hv=2, k=16, v=32, corrections=True)),
    ),
    doc="Token-serial KDA (decode, speculative verify with per-position states and delta-rule corrections)."))


def _rebuild(*, n, length, hv, k, v, kept, unwritten_nan=False):
    """unwritten_nan: record positions at or past each sequence's kept count hold NaN, as a
    record slot's unwritten tail does when a verify step had fewer drafts than slots."""
    def make(g, dtype):
        sd = state_dtype(dtype)
        keys = l2_normalised(g, (n, length, hv, k), sd)
        decays = uniform(g, (n, length, hv, k), -5.0, 0.0, sd)
        corrections = randn(g, (n, length, hv, v), sd, 0.5)
        if unwritten_nan:
            dropped = torch.arange(length)[None, :] >= torch.tensor(kept)[:, None]         # [N, L]
            for x in (keys, decays, corrections):
                x[dropped] = float("nan")
        return Inputs((randn(g, (n, hv, k, v), sd, 0.5), keys, decays, corrections,
                       torch.tensor(kept, dtype=torch.int64)))
    return make


register(Case(
    "kda.rebuild_state", "kda", "kda.rebuild_state", reference=ref.kda_rebuild_state,
    samples=(
        Sample("N4_L8_HV2_K16_V32_kept0-1-5-8", _rebuild(n=4, length=8, hv=2, k=16, v=32, kept=[0, 1, 5, 8])),
        Sample("N2_L3_HV2_K128_V128_kept3-2", _rebuild(n=2, length=3, hv=2, k=128, v=128, kept=[3, 2])),
        Sample("N3_L4_HV2_K16_V16_kept2-0-3_unwritten_tail_nan",
               _rebuild(n=3, length=4, hv=2, k=16, v=16, kept=[2, 0, 3], unwritten_nan=True)),
    ),
    doc="Closed-form KDA state after the first kept of L recorded tokens (speculative rollback)."))


# --------------------------------------------------------------- fused decode over state rows

def _decode_step(ctx, item):
    """Two fused decode steps over poisoned state rows (fresh rows first, then continuing
    ones), the state rows in the platform's KDA state layout; every row compared after each
    step (rows no sequence uses must stay poisoned)."""
    from .. import compare as cmp
    from ..inputs import poison_freed_memory, poisoned

    p, dtype = item.sample.params, TORCH_DTYPES[item.dtype]
    h, k, w, rows, slots = p["heads"], p["head_dim"], p["width"], p["rows"], p["slots"]
    sd, dev, tol = state_dtype(dtype), ctx.device, item.case.tolerance(item.dtype)
    g = torch.Generator().manual_seed(item.seed)
    n, c = len(slots), 3 * h * k
    conv_weight = randn(g, (c, w), dtype, 0.5)
    a_log = uniform(g, (h,), 0.0, math.log(16), sd)
    dt_bias = randn(g, (h, k), sd, 0.5)
    o_norm = randn(g, (k,), dtype, 0.3, 1.0)
    layout = ctx.platform.kda_state_layout

    def state_rows(dt, device):
        stored = (rows, h, k, k)
        rec = poisoned(stored, dt).to(device)
        return rec if layout == "hkv" else rec.transpose(-1, -2).contiguous().transpose(-1, -2)

    mine = (state_rows(sd, dev), poisoned((rows, c, w - 1), dtype).to(dev))
    oracle = (state_rows(torch.float64, "cpu"), poisoned((rows, c, w - 1), torch.float64))
    index = torch.tensor(slots, dtype=torch.int64)
    outcome = cmp.Outcome()
    for step in range(2):
        fresh = torch.tensor([step == 0 or s in p.get("refresh", ()) for s in slots])
        inputs = (randn(g, (n, c), dtype), conv_weight, randn(g, (n, h, k), dtype), a_log, dt_bias,
                  randn(g, (n, h), dtype), randn(g, (n, h, k), dtype), o_norm)
        kw = {"lower_bound": p["lower_bound"], "norm_eps": 1e-5}
        poison_freed_memory(dev)
        with torch.no_grad():
            got = ctx.platform.kernels.kda.decode_step(*(x.to(dev) for x in inputs), *mine, index.to(dev),
                                                       fresh.to(dev), **kw)
            want = item.case.reference(*(x.double() for x in inputs), *oracle, index, fresh, **kw)
        outcome.outputs.append(cmp.close(f"step{step}.o", got.cpu(), want, tol))
        outcome.outputs.append(cmp.close(f"step{step}.recurrent_rows", mine[0].cpu(), oracle[0], tol))
        outcome.outputs.append(cmp.close(f"step{step}.conv_rows", mine[1].cpu(), oracle[1], tol))
    return outcome


DECODE_ROWS = {"rows": 7, "slots": (4, 1, 6), "width": 4}

register(Case(
    "kda.decode_step", "kda", "kda.decode_step", reference=ref.kda_decode_step, run=_decode_step,
    tolerances=tolerances(float32=(2e-3, 1e-5), bfloat16=(5e-2, 1e-3)),
    samples=(
        Sample("N3_H2_K16_W4_rows7_k3_gate", params={"heads": 2, "head_dim": 16, "lower_bound": -5.0, **DECODE_ROWS}),
        Sample("N3_H2_K16_W4_softplus_gate_refresh", params={"heads": 2, "head_dim": 16, "lower_bound": None,
                                                             "refresh": (1,), **DECODE_ROWS}),
        Sample("N2_H3_K128_real_head_dim", params={"heads": 3, "head_dim": 128, "lower_bound": -5.0, "rows": 4,
                                                   "slots": (3, 0), "width": 4}),
    ),
    doc="Fused KDA decode (conv, gate, L2 norm, state update, gated RMSNorm) over cache state rows."))
