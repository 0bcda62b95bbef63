"""TPU capabilities, read from torch-xla's runtime (imported here, never at detection)."""

from __future__ import annotations

from k3.plugin.types import Capabilities


def read() -> Capabilities:
    """Capabilities of the XLA device: chip kind, memory limit, device count; compiled XLA
    graphs stand for graph capture; collectives go through XLA. The cache keeps typed regions
    (a write through a dtype view of one byte tensor executes XLA's pending graph)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    attrs = (xr.global_runtime_device_attributes() or [{}])[0]
    kind = str(attrs.get("type") or attrs.get("device_kind") or xr.device_type())     # e.g. "TPU v6 lite"
    try:
        memory = int(xm.get_memory_info(device).get("bytes_limit", 0))
    except Exception:       # PJRT's CPU client has no allocator statistics
        memory = 0
    return Capabilities(
        vendor="google", arch=kind.lower().replace(" ", "-"), device_name=kind, memory_bytes=memory,
        device_count=xr.global_runtime_device_count(), dist_backend="xla",
        dtypes=frozenset({"bfloat16", "float32"}), graph_capture=True, typed_cache_regions=True,
    )
