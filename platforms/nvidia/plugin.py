"""NVIDIA platform plugin (entry point `nvidia`): hook implementations only.

Backs detection, capabilities, serving defaults, conformance expectations, CUDA-graph capture
and, when Triton imports, the kernels of k3.platforms.triton_kernels (and torch_kernels): the
promoted set of experimental.py by default (K3_NVIDIA_DISABLE takes one out), the experimental
ones when K3_NVIDIA_EXPERIMENTAL names them. Every other kernel entry falls back to the
reference ops on device "cuda".
"""

from __future__ import annotations

from pathlib import Path

from k3.platforms._probe import has_module
from k3.plugin import AttnResKernels, IndexerKernels, KDAKernels, MLAKernels, MoEKernels, hookimpl

from . import capabilities, detect, experimental

K3_HOOKSPEC_VERSIONS = (1,)
NAME = detect.NAME
CONFORMANCE = Path(__file__).with_name("conformance.toml")


@hookimpl
def k3_detect_platform():
    return detect.detect()


@hookimpl
def k3_capabilities(platform):
    return capabilities.read() if platform.name == NAME else None


@hookimpl
def k3_config_defaults(platform):
    # vLLM's default memory fraction, which the NVIDIA quick start keeps.
    return {"gpu_memory_utilization": 0.9} if platform.name == NAME else None


@hookimpl
def k3_graph_runner(platform):
    if platform.name != NAME:
        return None
    from .graphs import CudaGraphCapturer

    return CudaGraphCapturer()


@hookimpl
def k3_conformance_expectations(platform):
    return str(CONFORMANCE) if platform.name == NAME else None


@hookimpl
def k3_kda_kernels(platform):
    if platform.name != NAME:
        return None
    try:
        from k3.platforms.triton_kernels import kda_decode
    except ImportError:          # no Triton: the reference ops serve every entry
        return None
    entries = {"decode_step": kda_decode.kda_decode_step} if experimental.enabled("kda_decode_step") else {}
    if experimental.enabled("kda_short_conv"):
        from k3.platforms.triton_kernels import short_conv

        entries["short_conv"] = short_conv.short_conv
    if experimental.enabled("kda_recurrent"):
        from k3.platforms.triton_kernels import kda_recurrent

        entries["recurrent"] = kda_recurrent.kda_recurrent
    if experimental.enabled("kda_chunked") and has_module("fla"):
        from k3.platforms.triton_kernels import kda_chunked

        entries["chunked"] = kda_chunked.kda_chunked
    return KDAKernels(**entries) if entries else None


@hookimpl
def k3_moe_kernels(platform):
    if platform.name != NAME or not has_module("triton"):
        return None
    entries = {}
    if experimental.enabled("moe_experts"):
        from k3.platforms.triton_kernels import moe_mxfp4

        entries["experts"] = moe_mxfp4.experts_forward
    if experimental.enabled("moe_router"):
        from k3.platforms.triton_kernels import router

        entries["select_experts"] = router.select_experts
    return MoEKernels(**entries) if entries else None


@hookimpl
def k3_mla_kernels(platform):
    if platform.name != NAME:
        return None
    entries = {}
    if experimental.enabled("mla_decode") and has_module("triton"):
        from k3.platforms.triton_kernels import mla_decode

        entries["decode"] = mla_decode.mla_decode
    if experimental.enabled("mla_prefill"):
        from k3.platforms.torch_kernels import mla_prefill_sdpa

        entries["prefill"] = mla_prefill_sdpa.mla_prefill
    return MLAKernels(**entries) if entries else None


@hookimpl
def k3_indexer_kernels(platform):
    if platform.name != NAME:
        return None
    entries = {}
    if experimental.enabled("indexer_decode_scores") and has_module("triton"):
        from k3.platforms.triton_kernels import indexer_decode

        entries["paged_decode_scores"] = indexer_decode.paged_decode_scores
    if experimental.enabled("indexer_prefill_scores") and has_module("triton"):
        from k3.platforms.triton_kernels import indexer_prefill

        entries["scores"] = indexer_prefill.indexer_scores
    if experimental.enabled("indexer_topk"):
        from k3.platforms.torch_kernels import indexer_topk

        entries["topk"] = indexer_topk.indexer_topk
    return IndexerKernels(**entries) if entries else None


@hookimpl
def k3_attn_res_kernels(platform):
    if platform.name != NAME or not experimental.enabled("attn_res_step") or not has_module("triton"):
        return None
    from k3.platforms.triton_kernels import attn_res

    return AttnResKernels(step=attn_res.attn_res)
