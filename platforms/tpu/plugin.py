"""TPU platform plugin (entry point `tpu`): hook implementations only.

Backs detection, capabilities (from torch-xla, imported only when the TPU is selected),
serving defaults and conformance expectations. No kernel yet: every kernel entry falls back to
the reference plugin's pure-torch kernels on the XLA device; docs/kernel-contract.md says which of them an XLA
backend must replace (host reads, CPU fallbacks).
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
    return {"gpu_memory_utilization": 0.9}


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)
