"""AMD platform plugin (entry point `amd`): hook implementations only.

Backs detection, capabilities, serving defaults, conformance expectations and the kernels of
kernels.py: the portable Triton kernels (k3.platforms.triton_kernels) and torch fast paths, each
with its target's launch configuration (archs.py: gfx942 / MI300X, gfx950 / MI355X), when the
modules it needs are installed and Triton can run on the device (the ROCm device, "cuda" in
torch, or the CPU under the Triton interpreter); K3_AMD_DISABLE takes one out. Every other
entry falls back to the reference plugin's pure-torch kernels. No graph runner and no
collective backend yet (capabilities claim neither). `K3_AMD_SIMULATE=gfx950` makes the
platform forceable on the CPU (simulate.py). A platform plugin's hooks are asked only while its
platform is selected, so none checks the platform name.
"""

from __future__ import annotations

from pathlib import Path

from k3.platforms._probe import has_module
from k3.plugin import (AttnResKernels, ElementwiseKernels, IndexerKernels, KDAKernels, MLAKernels, MoEKernels,
                       hookimpl)

from . import aiter_ops, archs, capabilities, detect, kernels
from .simulate import requested_arch, triton_runs

K3_HOOKSPEC_VERSIONS = (1,)
NAME = detect.NAME
CONFORMANCE = Path(__file__).with_name("conformance.toml")


def target(platform) -> archs.Arch:
    """The launch-table row of the selected device: the simulated target on the CPU, else the
    ROCm device's gfx arch."""
    if platform.device != "cuda":
        return archs.arch(requested_arch() or archs.DEFAULT_ARCH)
    import torch

    return archs.arch(torch.cuda.get_device_properties(0).gcnArchName)


@hookimpl
def k3_detect_platform():
    return detect.detect()


@hookimpl
def k3_capabilities(platform):
    if platform.device != "cuda":
        return capabilities.simulated(target(platform).name)
    return capabilities.read()


@hookimpl
def k3_config_defaults():
    # The AMD quick start of the Kimi K3.1 Pro release (MI355X): 16 sequences, 85 % of memory.
    return {"max_num_seqs": 16, "gpu_memory_utilization": 0.85}


@hookimpl
def k3_collective_backends(platform, group):
    """The IPC all-gather (ipc_allgather.py) where `hip_ipc` is claimed and the group has peers."""
    if platform.device != "cuda" or not capabilities.read().hip_ipc:
        return []
    import torch.distributed as dist

    if dist.get_world_size(group if group is not None else dist.group.WORLD) < 2:
        return []
    from .ipc_allgather import IpcAllGather

    return [IpcAllGather(group)]


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)


def _kernel_table(platform, family: str, table):
    """The `table` (a KernelTable class) of `family` with the served kernels of kernels.py
    bound to the target's launch options; None when none serves (the reference plugin serves
    every entry)."""
    def can_run(module: str) -> bool:          # FlyDSL and AITER run on a ROCm device only (no interpreter)
        if module in ("flydsl", "aiter") and platform.device != "cuda":
            return False
        if module == "aiter":
            return aiter_ops.status()[0]
        return has_module(module) and (module != "triton" or triton_runs(platform.device))

    entries = kernels.table_entries(family, target(platform), can_run)
    return table(**entries) if entries else None


@hookimpl
def k3_kda_kernels(platform):
    return _kernel_table(platform, "kda", KDAKernels)


@hookimpl
def k3_moe_kernels(platform):
    return _kernel_table(platform, "moe", MoEKernels)


@hookimpl
def k3_mla_kernels(platform):
    return _kernel_table(platform, "mla", MLAKernels)


@hookimpl
def k3_indexer_kernels(platform):
    return _kernel_table(platform, "indexer", IndexerKernels)


@hookimpl
def k3_attn_res_kernels(platform):
    return _kernel_table(platform, "attn_res", AttnResKernels)


@hookimpl
def k3_elementwise_kernels(platform):
    return _kernel_table(platform, "elementwise", ElementwiseKernels)
