"""The tiny models with every kernel the nvidia platform serves (fused KDA decode step, KDA
short conv, MoE experts and router, AttnRes, MLA decode and prefill, RMSNorm, GLU) in place of
the reference ops,
under the Triton interpreter: the conformance suite's model cases (greedy tokens and logits
against the reference model, chunked prefill mixed with decode, on the packed cache) pass in
bf16. This is the CPU half of what `k3 conformance --platform nvidia` checks on
the GPU."""

import dataclasses

import pytest

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform

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
