"""The tiny models with every kernel the nvidia platform serves (fused KDA decode step, KDA
short conv, MoE experts and router, AttnRes, MLA decode and prefill, RMSNorm, GLU) in place of
the reference ops,
under the Triton interpreter: the conformance suite's model cases (greedy tokens and logits
against the reference model, chunked prefill mixed with decode, on the packed cache) pass in
bf16. This is the CPU half of what `k3 conformance --platform nvidia` checks on
the GPU."""

import dataclasses

import pytest
import torch

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform
from k3.quant.mxfp4_tiles import TileMajorMXFP4

moe_mxfp4 = pytest.importorskip("k3.platforms.triton_kernels.moe_mxfp4")
from k3.platforms.torch_kernels import mla_prefill_sdpa  # noqa: E402
from k3.platforms.triton_kernels import attn_res, glu, kda_decode, mla_decode, rms_norm, router, short_conv  # noqa: E402

# bf16, the dtype the GPU serves: the fp32 k3.1-pro-tiny case took 95 s under the interpreter
# and checks the same kernels as the bf16 one; each kernel's fp32 path has its own test here,
# and `k3 conformance --platform nvidia` runs every model case in both dtypes on the GPU.
CASES = [i for i in items("full", ("model",)) if i.case.name == "model.greedy" and i.dtype == "bfloat16"
         and ("k3.1-pro-tiny" in i.sample.shape or "kimi-linear-tiny" in i.sample.shape)]


def with_kernels(platform):
    k = platform.kernels
    platform.kernels = dataclasses.replace(
        k,
        kda=dataclasses.replace(k.kda, decode_step=kda_decode.kda_decode_step, short_conv=short_conv.short_conv),
        moe=dataclasses.replace(k.moe, experts=moe_mxfp4.experts_forward, select_experts=router.select_experts),
        attn_res=dataclasses.replace(k.attn_res, step=attn_res.attn_res),
        elementwise=dataclasses.replace(k.elementwise, rms_norm=rms_norm.rms_norm, glu_activation=glu.glu_activation),
        mla=dataclasses.replace(k.mla, decode=mla_decode.mla_decode, prefill=mla_prefill_sdpa.mla_prefill))
    return platform


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_tiny_models_with_every_kernel(item):
    assert len(CASES) == 2
    outcome = run_item(RunContext(with_kernels(select_platform("reference"))), item)
    assert outcome.passed, outcome.summary()


TILES_CASE = [i for i in items("full", ("model",)) if i.case.name == "model.greedy" and i.dtype == "bfloat16"
              and "k3-tiny-tiles" in i.sample.shape]


def _experts_bf16_decode_interpreted(modes: list):
    """experts_forward_bf16_decode's GPU choice under the interpreter (which has no bf16 GPU
    batches, so its default_mode is "decode"): the decode_bf16 tiles (their fp32 decode,
    ptx=False) from BF16_DECODE_MIN_TOKENS tokens, the default mode below; each call's mode and
    whether its experts came tile-major appended to `modes`."""
    def experts(x, w13, w2, topk_weights, topk_ids, **kw):
        tiled = isinstance(w13, TileMajorMXFP4) and isinstance(w2, TileMajorMXFP4)
        if x.dtype == torch.bfloat16 and x.shape[0] >= moe_mxfp4.BF16_DECODE_MIN_TOKENS:
            modes.append(("decode_bf16", tiled))
            return moe_mxfp4.experts_forward(x, w13, w2, topk_weights, topk_ids, **kw, mode="decode_bf16",
                                             ptx=False, **moe_mxfp4.BF16_DECODE_TILE)
        modes.append(("default", tiled))
        return moe_mxfp4.experts_forward(x, w13, w2, topk_weights, topk_ids, **kw)
    return experts


@pytest.mark.parametrize("item", TILES_CASE, ids=lambda i: i.id)
def test_tiny_model_with_the_experts_repacked_tile_major(item):
    """The nvidia plugin's promoted moe_experts_bf16 path on a model: at load the experts are
    repacked tile-major (as its k3_process_weights does), then served by the decode_bf16 tiles on
    batches of 16+ tokens (the prefill chunks) and the default mode below; greedy tokens and
    logits must match the reference model's on k3-tiny-tiles. Only the experts run interpreted
    here (the other kernels' model run is the test above): that run took 117 s of CI's 2 cores."""
    assert len(TILES_CASE) == 1
    platform = select_platform("reference")
    modes = []
    platform.kernels = dataclasses.replace(platform.kernels, moe=dataclasses.replace(
        platform.kernels.moe, experts=_experts_bf16_decode_interpreted(modes)))
    repacked = []

    def process_weights(model):
        repacked.extend(m.hold_experts_tile_major() for m in model.modules() if hasattr(m, "hold_experts_tile_major"))

    platform.process_weights = process_weights
    outcome = run_item(RunContext(platform), item)
    assert repacked and all(repacked), repacked          # every MoE layer's experts were tileable and repacked
    assert outcome.passed, outcome.summary()
    assert {("decode_bf16", True), ("default", True)} <= set(modes), set(modes)   # both paths, tile-major only
    assert all(tiled for _, tiled in modes), set(modes)
