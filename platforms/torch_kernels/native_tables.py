"""The torch-native kernel set for a device without Triton (what the ppu plugin serves, and the
fastest path for any torch device k3 has no kernels for), built once per device
(`native_tables(device)`), each entry compiled with
`torch.compile` where the device supports it (`torch_kernels.device_support`: a CUDA device
with Triton, which a PPU lacks; the CPU runs them eagerly).

Every other entry (KDA gate, short conv, recurrent, rebuild; indexer key codecs, decode scores,
paged decode scores, Hadamard; router; layer / L2 norm; quant; LoRA) is the reference
platform's, which is already this torch code (`torch_kernels.tables`).
"""

from __future__ import annotations

import functools

from k3 import reference as ref
from . import indexer_scores_blocked, indexer_topk, kda_chunked_blocked, kda_decode, mla_decode, mla_prefill_sdpa
from . import moe_w4a16
from .device_support import maybe_compile
from k3.plugin.tables import (AttnResKernels, ElementwiseKernels, IndexerKernels, KDAKernels, KernelTable,
                              MLAKernels, MoEKernels)

# entry -> what serves it (the README's and the conformance report's list)
SERVED = {
    "moe.experts": "torch_kernels.moe_w4a16: dense (expert cache) experts by grouped GEMM over expert-sorted pairs "
                   "(torch._grouped_mm where the device has it), MXFP4 ones dequantised through a scaled byte "
                   "table a group at a time into a reused workspace; no host read in decode",
    "mla.prefill": "torch_kernels.mla_prefill_sdpa: expanded MLA on scaled_dot_product_attention",
    "mla.decode": "torch_kernels.mla_decode: absorbed MLA, batched matmuls over the gathered pages",
    "kda.chunked": "torch_kernels.kda_chunked_blocked: every chunk's intra-chunk work batched, exact fp32",
    "kda.decode_step": "torch_kernels.kda_decode: the fused decode step, compiled",
    "indexer.scores": "torch_kernels.indexer_scores_blocked: DSA prefill scores, every head in one product",
    "indexer.topk": "torch_kernels.indexer_topk: torch.topk instead of a full sort",
    "attn_res.step": "k3.reference.attn_res, compiled", "attn_res.mix": "k3.reference.attn_res_mix, compiled",
    "elementwise.rms_norm": "k3.reference.rms_norm, compiled",
    "elementwise.gated_rms_norm": "k3.reference.gated_rms_norm, compiled",
    "elementwise.glu_activation": "k3.reference.glu_activation, compiled",
}


@functools.cache
def native_tables(device: str) -> dict[str, KernelTable]:
    """family -> the torch-native table for `device` (the entries of SERVED)."""
    c = functools.partial(maybe_compile, device=device)
    return {
        "moe": MoEKernels(experts=moe_w4a16.build_experts(device)),
        "mla": MLAKernels(prefill=mla_prefill_sdpa.mla_prefill, decode=mla_decode.mla_decode),
        "kda": KDAKernels(chunked=kda_chunked_blocked.kda_chunked, decode_step=c(kda_decode.kda_decode_step)),
        "indexer": IndexerKernels(scores=indexer_scores_blocked.indexer_scores, topk=indexer_topk.indexer_topk),
        "attn_res": AttnResKernels(step=c(ref.attn_res), mix=c(ref.attn_res_mix)),
        "elementwise": ElementwiseKernels(rms_norm=c(ref.rms_norm), gated_rms_norm=c(ref.gated_rms_norm),
                                          glu_activation=c(ref.glu_activation)),
    }
