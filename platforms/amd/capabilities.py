"""AMD capabilities, read from the device (torch.cuda on a ROCm build) and the installed packages."""

from __future__ import annotations

from k3.plugin.types import Capabilities

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
    """Capabilities of ROCm device `device_index`: gfx arch, fp8 flavour, HIP graphs, HIP IPC
    (peer buffers across processes), RCCL, triton when it imports."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    arch = props.gcnArchName.split(":")[0]          # "gfx942:sramecc+:xnack-" -> "gfx942"
    return Capabilities(
        vendor="amd", arch=arch, device_name=props.name, memory_bytes=props.total_memory,
        device_count=torch.cuda.device_count(), dist_backend="rccl",
        dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}), fp8_dtype=FP8_BY_ARCH.get(arch),
        native_mxfp4=arch in NATIVE_MXFP4_ARCHS, triton=_imports("triton"), graph_capture=True, hip_ipc=True,
    )
