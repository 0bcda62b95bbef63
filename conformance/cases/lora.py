"""LoRA (`LoRAKernels`): the per-row adapter delta and the routed experts with per-expert
adapters. Every sample mixes slots and rows without an adapter (-1), whose delta must be zero."""

from __future__ import annotations

import torch

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor

from ..inputs import Inputs, randn, state_dtype
from ..registry import Case, Sample, register, tolerances


def _slots(g, t, s):
    return torch.randint(-1, s, (t,), generator=g)                  # -1: the base model


def _delta(t, s, r, d_in, d_out):
    def make(g, dtype):
        return Inputs((randn(g, (t, d_in), dtype), randn(g, (s, r, d_in), dtype, d_in ** -0.5),
                       randn(g, (s, d_out, r), dtype, r ** -0.5), randn(g, (s,), state_dtype(dtype), 1.0, 1.0),
                       _slots(g, t, s)))
    return make


register(Case(
    "lora.delta", "lora", "lora.delta", reference=ref.lora_delta, outputs=lambda o, a, k: {"delta": o},
    tolerances=tolerances(bfloat16=(2e-2, 2e-3)),
    samples=(
        Sample("T37_S3_R8_in64_out96", _delta(37, 3, 8, 64, 96)),
        Sample("T1_S2_R32_in128_out64_decode", _delta(1, 2, 32, 128, 64)),
        Sample("T64_S4_R16_in32_out256", _delta(64, 4, 16, 32, 256)),
    ),
    doc="y[t] += scale[i] B[i] A[i] x[t] for the row's slot i; rows of slot -1 get exactly zero."))


def _experts(t, e, k, l, i, s, r, *, mxfp4=False):
    def make(g, dtype):
        if mxfp4:
            def weight(out, fan_in):
                packed = torch.randint(0, 256, (e, out, fan_in // 2), generator=g, dtype=torch.uint8)
                scales = (122 + torch.randint(-1, 1, (e, out, fan_in // 32), generator=g)).to(torch.uint8)
                return MXFP4Tensor(packed, scales)
            w13, w2 = weight(2 * i, l), weight(l, i)
        else:
            w13, w2 = randn(g, (e, 2 * i, l), dtype, l ** -0.5), randn(g, (e, l, i), dtype, i ** -0.5)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        weights = torch.rand((t, k), generator=g, dtype=torch.float64).add(0.1).to(state_dtype(dtype))
        w13_lora = [(slice(0, i), randn(g, (s, e, r, l), dtype, l ** -0.5), randn(g, (s, e, i, r), dtype, r ** -0.5)),
                    (slice(i, 2 * i), randn(g, (s, e, r, l), dtype, l ** -0.5),
                     randn(g, (s, e, i, r), dtype, r ** -0.5))]
        w2_lora = [(slice(0, l), randn(g, (s, e, r, i), dtype, i ** -0.5), randn(g, (s, e, l, r), dtype, r ** -0.5))]
        kw = {"w13_lora": w13_lora, "w2_lora": w2_lora, "scales": randn(g, (s,), state_dtype(dtype), 0.5, 1.0),
              "activation": "situ", "beta": 4.0, "linear_beta": 25.0}
        return Inputs((randn(g, (t, l), dtype), w13, w2, weights, ids, _slots(g, t, s)), kw)
    return make


register(Case(
    "lora.experts", "lora", "lora.experts", reference=ref.lora_experts_forward, outputs=lambda o, a, k: {"out": o},
    tolerances=tolerances(bfloat16=(2e-2, 2e-3)),
    samples=(
        Sample("T23_E8_k2_L32_I32_S2_R8_dense", _experts(23, 8, 2, 32, 32, 2, 8)),
        Sample("T9_E8_k2_L64_I32_S3_R4_mxfp4", _experts(9, 8, 2, 64, 32, 3, 4, mxfp4=True)),
    ),
    doc="Routed experts with each token's adapter on w1 / w3 (before the activation) and w2."))
