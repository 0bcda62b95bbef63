"""TPU capabilities, read from torch-xla's runtime (imported here, never at detection).

Only what the plugin implements and conformance checks: bf16 and fp32 activations (fp64 too on
PJRT's CPU device, where XLA computes it natively; a TPU does not), fp8 e4m3fn (the fp8 codec,
fp8 latent and index-key pages: XLA's F8E4M3FN conversions inside the graphs), compiled XLA
graphs as graph capture (`graphs.py`), collectives through XLA. No native MXFP4 / NVFP4 (the
codecs are dequantised in the graph), no Triton, no symmetric memory, DCP or PD transfer.
"""

from __future__ import annotations

from k3.plugin.types import Capabilities


def read() -> Capabilities:
    """Capabilities of the XLA device: chip kind, memory limit, device count, the dtypes above.
    The cache keeps typed regions (a write through a dtype view of one byte tensor executes
    XLA's pending graph)."""
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
    dtypes = {"bfloat16", "float32"} | ({"float64"} if xr.device_type() == "CPU" else set())
    return Capabilities(
        vendor="google", arch=kind.lower().replace(" ", "-"), device_name=kind, memory_bytes=memory,
        device_count=xr.global_runtime_device_count(), dist_backend="xla", dtypes=frozenset(dtypes),
        fp8_dtype="e4m3fn", graph_capture=True, typed_cache_regions=True,
    )
