"""T-HEAD PPU platform plugin (entry point `ppu`): hook implementations only.

The torch-native path on T-HEAD's CUDA-compatible torch device ("cuda"), no Triton: the
kernel entries of `k3.platforms.torch_kernels.native_tables` (W4A16 MoE, SDPA MLA prefill, absorbed MLA decode, the batched
chunked KDA prefill, the compiled KDA decode step, DSA indexer scores and top-k, AttnRes and
norms; `torch.compile` where the device supports it), every other entry the reference
plugin's torch kernels; decode steps recorded as graphs on a CUDA-compatible device
(graphs.py). Forceable: `--platform ppu` runs the same path on any torch device (the CPU here),
which is how it is tested without a PPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from k3.plugin import hookimpl

from . import capabilities, detect

K3_HOOKSPEC_VERSIONS = (1,)
NAME = detect.NAME
CONFORMANCE = Path(__file__).with_name("conformance.toml")
EXPERT_CACHE_ENV = "K3_PPU_EXPERT_CACHE"       # auto | on | off: the default of --expert-cache on ppu


@hookimpl
def k3_detect_platform():
    return detect.detect()


@hookimpl
def k3_capabilities(platform):
    return capabilities.read(platform.device)


@hookimpl
def k3_config_defaults():
    # the expert cache (k3.engine.expert_cache): the torch-native experts read dense bf16 experts at
    # 2 bytes a weight, MXFP4 ones dequantised on the fly at 6.5+ (README.md); auto holds them dense
    # when the capacity plan still fits
    return {"gpu_memory_utilization": 0.9, "expert_cache": os.environ.get(EXPERT_CACHE_ENV, "auto")}


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)


@hookimpl
def k3_graph_runner(platform):
    from k3.platforms.torch_kernels.device_support import graphs_supported

    if not graphs_supported(platform.device):
        return None                              # the CPU: every decode step runs eagerly
    from .graphs import CompiledGraphCapturer

    return CompiledGraphCapturer(platform.device)


def _table(family: str, platform):
    from k3.platforms.torch_kernels.native_tables import native_tables

    return native_tables(platform.device)[family]


@hookimpl
def k3_kda_kernels(platform):
    return _table("kda", platform)


@hookimpl
def k3_moe_kernels(platform):
    return _table("moe", platform)


@hookimpl
def k3_mla_kernels(platform):
    return _table("mla", platform)


@hookimpl
def k3_indexer_kernels(platform):
    return _table("indexer", platform)


@hookimpl
def k3_attn_res_kernels(platform):
    return _table("attn_res", platform)


@hookimpl
def k3_elementwise_kernels(platform):
    return _table("elementwise", platform)
