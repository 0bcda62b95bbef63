"""Which Triton kernels the nvidia platform serves: the promoted set (each passed the
conformance suite on the H200, conformance/reports/nvidia-h200/) by default, minus any named in
K3_NVIDIA_DISABLE (a comma-separated list, or "all": the reference op serves that entry
instead, for bisecting a wrong output); plus the experimental kernels, written but not served
until named in K3_NVIDIA_EXPERIMENTAL (a list, or "all"), so a developer can run
`K3_NVIDIA_EXPERIMENTAL=all k3 conformance --platform nvidia` and the benchmarks on a GPU
before promoting one (promotion needs a passing device report).
"""

from __future__ import annotations

import os
import warnings

ENV = "K3_NVIDIA_EXPERIMENTAL"
DISABLE_ENV = "K3_NVIDIA_DISABLE"
PROMOTED = {
    "kda_decode_step": "fused KDA decode step (conv, gates, L2 norms, state update, gated RMSNorm)",
    "kda_short_conv": "causal short conv of prefill chunks and verify steps, ragged, with checkpoint windows",
    "moe_experts": "MXFP4 routed experts, W4A16, SiTU-GLU fused",
    "moe_router": "expert selection (scores, bias, top-k, renormalisation) in one launch",
    "attn_res_step": "fused Block AttnRes step",
    "mla_decode": "absorbed MLA decode over paged latents, split-K flash decoding",
    "mla_prefill": "MLA prefill on torch's fused attention (flash / memory-efficient kernels)",
}
KERNELS = {
    "kda_chunked": "chunked KDA prefill with checkpoints over fla-core's chunk_kda (needs fla-core)",
    "kda_recurrent": "token-serial KDA for speculative verify: per-position states and corrections",
    "indexer_decode_scores": "DSA indexer decode scores read from the fp8 key pages through the block table",
    "indexer_topk": "DSA indexer top-k on torch.topk (radix select) instead of a full stable sort",
    "indexer_prefill_scores": "DSA indexer prefill scores over the packed batch in one launch",
}


def _names(env: str, known: dict) -> set[str]:
    names = {n.strip() for n in os.environ.get(env, "").split(",") if n.strip()}
    unknown = names - set(known) - {"all"}
    if unknown:
        warnings.warn(f"{env}: unknown kernel name(s) {sorted(unknown)} ignored; known: "
                      f"{', '.join(sorted(known))}, or all", stacklevel=3)
    return names


def enabled(name: str) -> bool:
    """True when kernel `name` serves: a promoted one unless K3_NVIDIA_DISABLE names it, an
    experimental one (a key of KERNELS) only when K3_NVIDIA_EXPERIMENTAL names it."""
    if name in PROMOTED:
        disabled = _names(DISABLE_ENV, PROMOTED)
        return name not in disabled and "all" not in disabled
    assert name in KERNELS, name
    names = _names(ENV, KERNELS)
    return name in names or "all" in names
