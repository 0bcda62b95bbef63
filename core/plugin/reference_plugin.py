"""The reference plugin: pure torch on any device, always registered, `trylast`.

It backs every hook with k3.reference ops, so every kernel table resolves; a vendor plugin
replaces only the entries it really implements.
"""

from __future__ import annotations

import os

import torch

from k3 import reference as ref
from k3.model.parallel import TorchDistributedCollectives

from .markers import HOOKSPEC_VERSION, hookimpl
from .types import (
    AttnResKernels,
    Capabilities,
    Detection,
    ElementwiseKernels,
    IndexerKernels,
    KDAKernels,
    MLAKernels,
    MoEKernels,
    QuantKernels,
)

K3_HOOKSPEC_VERSIONS = (HOOKSPEC_VERSION,)
NAME = "reference"


def reference_tables() -> dict[str, object]:
    """Every kernel table filled with the reference ops (family -> table)."""
    return {
        "kda": KDAKernels(gate=ref.kda_gate, short_conv=ref.short_conv, chunked=ref.kda_chunked,
                          recurrent=ref.kda_recurrent, rebuild_state=ref.kda_rebuild_state,
                          decode_step=ref.kda_decode_step),
        "mla": MLAKernels(prefill=ref.mla_prefill, decode=ref.mla_decode),
        "indexer": IndexerKernels(quantize_keys=ref.indexer_quantize_keys,
                                  dequantize_keys=ref.indexer_dequantize_keys, scores=ref.indexer_scores,
                                  decode_scores=ref.indexer_decode_scores,
                                  paged_decode_scores=ref.indexer_paged_decode_scores,
                                  topk=ref.indexer_topk, hadamard=ref.hadamard_transform),
        "moe": MoEKernels(router_logits=ref.router_logits, select_experts=ref.select_experts,
                          experts=ref.experts_forward),
        "attn_res": AttnResKernels(step=ref.attn_res, mix=ref.attn_res_mix),
        "elementwise": ElementwiseKernels(rms_norm=ref.rms_norm, gated_rms_norm=ref.gated_rms_norm,
                                          layer_norm=ref.layer_norm, l2_norm=ref.l2_norm,
                                          glu_activation=ref.glu_activation),
        "quant": QuantKernels(fp8_quantize=ref.fp8_quantize, fp8_dequantize=ref.fp8_dequantize,
                              mxfp4_quantize=ref.mxfp4_quantize, mxfp4_dequantize=ref.mxfp4_dequantize,
                              nvfp4_quantize=ref.nvfp4_quantize, nvfp4_dequantize=ref.nvfp4_dequantize),
    }


class TorchDistributedBackend(TorchDistributedCollectives):
    """torch.distributed collectives (gloo on the CPU, NCCL/RCCL on GPUs): accepts everything."""

    name = "torch.distributed"

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return True


@hookimpl(trylast=True)
def k3_detect_platform():
    return Detection(name=NAME, available=True, reason="pure torch on the CPU (always available)",
                     forceable=True, priority=-100, device="cpu")


@hookimpl(trylast=True)
def k3_capabilities(platform):
    if platform.name != NAME:
        return None
    return Capabilities(vendor="cpu", arch=os.uname().machine, device_name="CPU (reference ops)",
                        device_count=1, dist_backend="gloo",
                        dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}), fp8_dtype="e4m3fn")


def _table(family: str):
    @hookimpl(trylast=True)
    def hook(platform):
        return reference_tables()[family]

    return hook


k3_kda_kernels = _table("kda")
k3_mla_kernels = _table("mla")
k3_indexer_kernels = _table("indexer")
k3_moe_kernels = _table("moe")
k3_attn_res_kernels = _table("attn_res")
k3_elementwise_kernels = _table("elementwise")
k3_quant_kernels = _table("quant")


@hookimpl(trylast=True)
def k3_collective_backends(platform, group):
    return [TorchDistributedBackend(group)]


@hookimpl(trylast=True)
def k3_allocate_cache(platform, num_rows, row_bytes, alignment):
    # allocators align to 64 (CPU) or 512 bytes (CUDA): over-allocate and start at an aligned byte
    raw = torch.full((num_rows * row_bytes + alignment,), 0xFF, dtype=torch.uint8, device=platform.device)
    start = (-raw.data_ptr()) % alignment
    return raw[start: start + num_rows * row_bytes].view(num_rows, row_bytes)


@hookimpl(trylast=True)
def k3_kda_state_layout(platform):
    return "hkv"


@hookimpl(trylast=True)
def k3_graph_runner(platform):
    return None                 # decode runs eagerly


@hookimpl(trylast=True)
def k3_process_weights(platform, model):
    return None


@hookimpl(trylast=True)
def k3_config_defaults(platform):
    return {}


@hookimpl(trylast=True)
def k3_validate_config(platform, config, options):
    return []


@hookimpl(trylast=True)
def k3_add_cli_options(parser, platform_name):
    return None


@hookimpl(trylast=True)
def k3_conformance_expectations(platform):
    return None
