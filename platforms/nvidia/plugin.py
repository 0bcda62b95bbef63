"""NVIDIA platform plugin (entry point `nvidia`): hook implementations only.

Backs detection, capabilities, serving defaults, conformance expectations and, when Triton
imports, the Triton kernels of k3.platforms.triton_kernels (today the fused KDA decode step).
Every other kernel entry falls back to the reference ops on device "cuda".
"""

from __future__ import annotations

from pathlib import Path

from k3.plugin import KDAKernels, hookimpl

from . import capabilities, detect

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
    return KDAKernels(decode_step=kda_decode.kda_decode_step)
