"""T-HEAD PPU platform plugin (entry point `ppu`): hook implementations only.

The torch-native path: the reference plugin's pure-torch kernels on T-HEAD's CUDA-compatible torch device ("cuda"),
no Triton. Forceable: `--platform ppu` runs the same path on any torch device (the CPU here),
which is how it is tested without a PPU. Backs detection, capabilities, serving defaults and
conformance expectations; every kernel entry is the reference's.
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
def k3_capabilities(platform):
    return capabilities.read(platform.device)


@hookimpl
def k3_config_defaults():
    return {"gpu_memory_utilization": 0.9}


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)
