"""T-HEAD PPU capabilities: what torch reports for the device the torch-native path runs on."""

from __future__ import annotations

import platform

from k3.plugin.types import Capabilities


def read(device: str) -> Capabilities:
    """Capabilities of the torch-native path on `device` ("cuda": the PPU through T-HEAD's
    CUDA-compatible torch; "cpu": a forced run without one). fp8 is e4m3fn because the path
    uses the reference codecs (torch dtype casts); graph capture on a CUDA-compatible device
    (graphs.py records decode steps as CUDA graphs), none on the CPU."""
    import torch
    import torch.distributed as dist

    if device != "cuda":
        return Capabilities(vendor="t-head", arch=platform.machine(), device_name="CPU (PPU torch-native path)",
                            device_count=1, dist_backend="gloo", fp8_dtype="e4m3fn",
                            dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}))
    props = torch.cuda.get_device_properties(0)
    dtypes = {"float16", "float32", "float64"} | ({"bfloat16"} if torch.cuda.is_bf16_supported() else set())
    return Capabilities(
        vendor="t-head", arch=f"cc_{props.major}{props.minor}", device_name=props.name,
        memory_bytes=props.total_memory, device_count=torch.cuda.device_count(),
        dist_backend="nccl" if dist.is_available() and dist.is_nccl_available() else "gloo",
        dtypes=frozenset(dtypes), fp8_dtype="e4m3fn", graph_capture=True,
    )
