"""AMD capabilities, read from the device (torch.cuda on a ROCm build) and the installed packages,
or those of the simulated target (K3_AMD_SIMULATE, simulate.py) on the CPU. Claims only what
the plugin implements and can run here: no HIP graph runner exists, so `graph_capture` stays
False; `hip_ipc` (the IPC all-gather) and `aiter` only when opted in and runnable (neither has
executed on AMD hardware)."""

from __future__ import annotations

import platform as host

from k3.plugin.types import Capabilities

from . import aiter_ops, archs, ipc_allgather
from .simulate import triton_runs

# fp8 flavour of the matrix cores: MI300 (gfx942) uses the FNUZ encoding, MI350 (gfx950) OCP's.
FP8_BY_ARCH = {"gfx942": "e4m3fnuz", "gfx950": "e4m3fn"}
NATIVE_MXFP4_ARCHS = {"gfx950"}     # CDNA4 matrix cores take MXFP4 operands


def _imports(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


def read(device_index: int = 0) -> Capabilities:
    """Capabilities of ROCm device `device_index`: gfx arch, fp8 flavour, native MXFP4, RCCL,
    triton when it imports, aiter when K3_AMD_AITER=1 and AITER imports (aiter_ops.status),
    hip_ipc when K3_AMD_HIP_IPC=1 and two GPUs are visible (ipc_allgather); graph capture not
    claimed (not implemented)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    arch = props.gcnArchName.split(":")[0]          # "gfx942:sramecc+:xnack-" -> "gfx942"
    return Capabilities(
        vendor="amd", arch=arch, device_name=props.name, memory_bytes=props.total_memory,
        device_count=torch.cuda.device_count(), dist_backend="rccl",
        dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}), fp8_dtype=FP8_BY_ARCH.get(arch),
        native_mxfp4=arch in NATIVE_MXFP4_ARCHS, triton=_imports("triton"), aiter=aiter_ops.status()[0],
        hip_ipc=ipc_allgather.enabled_by_env() and torch.cuda.device_count() >= 2,
    )


def simulated(arch: str) -> Capabilities:
    """Capabilities of the simulated target `arch` on the CPU: its fp8 flavour and MXFP4 flag
    (what the conformance cases pick inputs by), triton only under the interpreter, gloo."""
    target = archs.arch(arch)
    return Capabilities(
        vendor="amd", arch=target.name, device_name=f"simulated {target.name} ({target.product}) on the CPU "
        f"({host.machine()})", device_count=1, dist_backend="gloo",
        dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}), fp8_dtype=FP8_BY_ARCH[target.name],
        native_mxfp4=target.native_mxfp4, triton=_imports("triton") and triton_runs("cpu"),
    )
