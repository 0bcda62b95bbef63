"""Kernels written for the nvidia platform but not served by default: each enters the kernel
tables only when named in K3_NVIDIA_EXPERIMENTAL (a comma-separated list, or "all"), so a
developer can run `K3_NVIDIA_EXPERIMENTAL=all k3 conformance --platform nvidia` and the
benchmarks on a GPU before a kernel is promoted to the default set (promotion needs a passing
conformance report on the device, conformance/reports/nvidia-h200/).
"""

from __future__ import annotations

import os
import warnings

ENV = "K3_NVIDIA_EXPERIMENTAL"
KERNELS = {
    "kda_chunked": "chunked KDA prefill with checkpoints over fla-core's chunk_kda (needs fla-core)",
    "kda_short_conv": "causal short conv of prefill chunks and verify steps, ragged, with checkpoint windows",
    "moe_experts": "MXFP4 routed experts, W4A16, SiTU-GLU fused",
    "moe_router": "expert selection (scores, bias, top-k, renormalisation) in one launch",
    "attn_res_step": "fused Block AttnRes step",
    "mla_decode": "absorbed MLA decode over paged latents, split-K flash decoding",
    "mla_prefill": "MLA prefill on torch's fused attention (flash / memory-efficient kernels)",
}


def enabled(name: str) -> bool:
    """True when `name` (a key of KERNELS) is switched on by K3_NVIDIA_EXPERIMENTAL."""
    assert name in KERNELS, name
    names = {n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()}
    unknown = names - set(KERNELS) - {"all"}
    if unknown:
        warnings.warn(f"{ENV}: unknown kernel name(s) {sorted(unknown)} ignored; known: "
                      f"{', '.join(sorted(KERNELS))}, or all", stacklevel=2)
    return name in names or "all" in names
