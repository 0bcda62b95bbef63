"""NVIDIA capabilities, read from the device (torch.cuda) and the installed packages."""

from __future__ import annotations

from k3.plugin.types import Capabilities


def _imports(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:            # ImportError, or a package that fails on this machine
        return False


def read(device_index: int = 0) -> Capabilities:
    """Capabilities of CUDA device `device_index` (all devices of a node are alike).

    fp8 e4m3fn from sm_89 (Ada, Hopper), native MXFP4 / NVFP4 tensor cores from sm_100
    (Blackwell), CUDA graphs, torch symmetric memory when it imports, triton when it imports,
    NCCL.
    """
    import torch
    import torch.distributed as dist

    props = torch.cuda.get_device_properties(device_index)
    cc = (props.major, props.minor)
    dtypes = {"float16", "float32", "float64"} | ({"bfloat16"} if props.major >= 8 else set())
    return Capabilities(
        vendor="nvidia", arch=f"sm_{props.major}{props.minor}", device_name=props.name,
        memory_bytes=props.total_memory, device_count=torch.cuda.device_count(),
        dist_backend="nccl" if dist.is_available() and dist.is_nccl_available() else "gloo",
        dtypes=frozenset(dtypes), fp8_dtype="e4m3fn" if cc >= (8, 9) else None,
        native_mxfp4=props.major >= 10, native_nvfp4=props.major >= 10,
        triton=_imports("triton"), graph_capture=True,
        symmetric_memory=_imports("torch.distributed._symmetric_memory"),
    )
