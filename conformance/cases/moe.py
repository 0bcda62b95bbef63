"""MoE (`MoEKernels`): router logits, expert selection, routed experts (dense and MXFP4).

Selected expert ids are compared as sets per token (a different pick among exactly tied
selection scores is accepted); the routing weights are compared as a dense [T, E] matrix, so a
weight attached to the wrong expert fails.
"""

from __future__ import annotations

import inspect

import torch

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor
from k3.quant.mxfp4_tiles import to_tile_major
from k3.reference.router import _group_mask

from .. import compare as cmp
from ..inputs import Inputs, randn, state_dtype
from ..registry import Case, Sample, register, tolerances


def _router(t, d, e):
    return lambda g, dtype: Inputs((randn(g, (t, d), dtype), randn(g, (e, d), dtype, d ** -0.5)))


register(Case(
    "moe.router_logits", "moe", "moe.router_logits", reference=ref.router_logits,
    tolerances=tolerances(bfloat16=(1e-3, 1e-4)), outputs=lambda o, a, k: {"logits": o},
    samples=(
        Sample("T37_D64_E8", _router(37, 64, 8)),
        Sample("T9_D256_E384", _router(9, 256, 384)),
        Sample("T1_D7168_E16_decode", _router(1, 7168, 16)),
    ),
    doc="fp32 router logits (both operands upcast: bf16 rounding of the product is not allowed)."))


def _select(t, e, k, *, scoring="sigmoid", bias=True, renormalize=True, scale=1.0, groups=1, topk_group=1):
    def make(g, dtype):
        sd = state_dtype(dtype)
        kw = {"top_k": k, "correction_bias": randn(g, (e,), sd, 0.1) if bias else None, "scoring": scoring,
              "renormalize": renormalize, "routed_scaling_factor": scale, "num_expert_group": groups,
              "topk_group": topk_group}
        return Inputs((randn(g, (t, e), sd, 2.0),), kw)
    return make


def _selection_scores(inputs: Inputs) -> torch.Tensor:
    """The reference's selection scores (biased, group-masked) of select_experts' inputs."""
    logits, kw = inputs.args[0].double(), inputs.kwargs
    scores = torch.sigmoid(logits) if kw["scoring"] == "sigmoid" else torch.softmax(logits, -1)
    if kw["correction_bias"] is not None:
        scores = scores + kw["correction_bias"].double()
    if kw["num_expert_group"] > 1:
        scores = scores.masked_fill(~_group_mask(scores, kw["num_expert_group"], kw["topk_group"]), float("-inf"))
    return scores


def _select_outputs(result, args, kwargs):
    weights, ids = result.weights, result.ids
    dense = torch.zeros(weights.shape[0], args[0].shape[1], dtype=torch.float64, device=weights.device)
    dense.scatter_(1, ids.long(), weights.double())            # [T, E]: each weight at its expert
    return {"ids": ids, "weights": weights, "weights_by_expert": dense}


register(Case(
    "moe.select_experts", "moe", "moe.select_experts", reference=ref.select_experts,
    dtypes=("float32", "float64"), outputs=_select_outputs,
    compare={"ids": lambda n, o, r, tol, inp: cmp.topk_sets(n, o, r, _selection_scores(inp)), "weights": "skip"},
    samples=(
        Sample("T37_E8_k2_sigmoid_bias_k3", _select(37, 8, 2)),
        Sample("T20_E64_k6_grouped8_top4_scale2.5", _select(20, 64, 6, groups=8, topk_group=4, scale=2.5)),
        Sample("T9_E16_k4_softmax_no_renorm_no_bias", _select(9, 16, 4, scoring="softmax", bias=False,
                                                               renormalize=False)),
        Sample("T5_E384_k8_sigmoid_bias", _select(5, 384, 8, scale=2.446)),
    ),
    doc="Top-k experts by biased score; unbiased, renormalised, scaled weights."))


def _experts(t, e, k, l, i, *, mxfp4=False, activation="situ", start=0, local=None, dense_dispatch=None,
             tile_major=False):
    """tile_major: the MXFP4 stacks repacked tile by tile (`k3.quant.mxfp4_tiles`), as a platform's
    `k3_process_weights` may hold them (the nvidia plugin's `moe_experts_bf16` does); L and I must
    then divide into the 128 x 64 tiles."""
    def make(g, dtype):
        el = local or e
        if mxfp4:   # random codes, E8M0 scales giving weights of rms ~ 1/sqrt(fan_in)
            def weight(out, fan_in, exp):
                packed = torch.randint(0, 256, (el, out, fan_in // 2), generator=g, dtype=torch.uint8)
                scales = (127 + exp + torch.randint(-1, 1, (el, out, fan_in // 32), generator=g)).to(torch.uint8)
                return MXFP4Tensor(packed, scales)
            w13, w2 = weight(2 * i, l, -5), weight(l, i, -5)
            if tile_major:
                w13, w2 = to_tile_major(w13), to_tile_major(w2)
        else:
            w13, w2 = randn(g, (el, 2 * i, l), dtype, l ** -0.5), randn(g, (el, l, i), dtype, i ** -0.5)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])     # [T, k] global ids
        weights = torch.rand((t, k), generator=g, dtype=torch.float64).add(0.1).to(state_dtype(dtype))
        kw = {"activation": activation, "beta": 4.0 if activation == "situ" else None,
              "linear_beta": 25.0 if activation == "situ" else None, "expert_start": start}
        if dense_dispatch is not None:
            kw["dense_dispatch"] = dense_dispatch
        return Inputs((randn(g, (t, l), dtype), w13, w2, weights, ids), kw)
    return make


SAMPLES = [
    Sample("T23_E8_k2_L32_I32_dense_situ", _experts(23, 8, 2, 32, 32)),
    Sample("T19_E8_k2_L64_I32_mxfp4_situ", _experts(19, 8, 2, 64, 32, mxfp4=True)),
    Sample("T17_E4of8_start4_k2_L32_I16_expert_parallel_silu",
           _experts(17, 8, 2, 32, 16, activation="silu", start=4, local=4)),
    Sample("T1_E8_k3_L64_I64_mxfp4_single_token", _experts(1, 8, 3, 64, 64, mxfp4=True)),
    # a prefill chunk's size: plugins may switch strategy there (nvidia: dequantise each expert, cuBLAS)
    Sample("T8192_E8_k2_L64_I32_mxfp4_prefill_chunk", _experts(8192, 8, 2, 64, 32, mxfp4=True)),
    # the experts repacked tile-major (128-row x 64-column tiles): the gemv's, the decode tiles' and the
    # prefill mode's batch sizes
    Sample("T1_E8_k2_L128_I64_mxfp4_tile_major", _experts(1, 8, 2, 128, 64, mxfp4=True, tile_major=True)),
    Sample("T32_E8_k2_L128_I128_mxfp4_tile_major", _experts(32, 8, 2, 128, 128, mxfp4=True, tile_major=True)),
    Sample("T1024_E8_k2_L128_I64_mxfp4_tile_major_prefill",
           _experts(1024, 8, 2, 128, 64, mxfp4=True, tile_major=True)),
    # what AMD's AITER fused MoE takes (MXFP4 SiLU-GLU at widths of its tiles): runs where it serves
    Sample("aiter_T4_E8_k2_L512_I256_mxfp4_silu", _experts(4, 8, 2, 512, 256, mxfp4=True, activation="silu"),
           requires=("aiter",)),
]
if "dense_dispatch" in inspect.signature(ref.experts_forward).parameters:
    SAMPLES.append(Sample("T6_E8_k2_L64_I32_mxfp4_dense_dispatch",
                          _experts(6, 8, 2, 64, 32, mxfp4=True, dense_dispatch=True)))

register(Case(
    "moe.experts", "moe", "moe.experts", reference=ref.experts_forward, outputs=lambda o, a, k: {"out": o},
    samples=tuple(SAMPLES),
    doc="Routed experts over stacked dense or MXFP4 weights; this rank's partial sum under EP."))
