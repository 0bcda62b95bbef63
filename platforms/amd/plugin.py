"""AMD platform plugin (entry point `amd`): hook implementations only.

Backs detection, capabilities, serving defaults and conformance expectations. No kernel yet
(Triton / AITER / FlyDSL kernels come with later issues): every kernel entry falls back to the
reference plugin's pure-torch kernels (k3.platforms.torch_kernels.tables) on the ROCm device ("cuda" in torch).
"""

from __future__ import annotations

from pathlib import Path

from k3.plugin import hookimpl

from . import capabilities, detect

K3_HOOKSPEC_VERSIONS = (1,)
NAME = detect.NAME
CONFORMANCE = Path(__file__).with_name("conformance.toml")


@hookimpl
def k3_detect_platform():
    return detect.detect()


@hookimpl
def k3_capabilities():
    return capabilities.read()


@hookimpl
def k3_config_defaults():
    # The AMD quick start of the Kimi K3.1 Pro release (MI355X): 16 sequences, 85 % of memory.
    return {"max_num_seqs": 16, "gpu_memory_utilization": 0.85}


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)
