"""The pure-torch kernel set: every kernel table filled, what the reference platform serves.

Each entry is this package's torch fast path where there is one, else the `k3.reference` op
itself. The reference plugin (`k3.platform.reference`) returns these tables, and the model
built without a platform (`k3.model.reference_kernels()`) runs on them, so the tests and
`--platform reference` run at today's speed while conformance checks every fast path against
the naive reference.
"""

from __future__ import annotations

from k3 import reference as ref
from k3.plugin.tables import (
    AttnResKernels,
    DenseKernels,
    ElementwiseKernels,
    IndexerKernels,
    KDAKernels,
    KernelTable,
    MLAKernels,
    LoRAKernels,
    MoEKernels,
    QuantKernels,
)

from . import dense, hadamard, indexer_paged_decode, kda_chunked, kda_decode, kda_rebuild, kda_recurrent, mla_decode
from . import moe_experts, short_conv


def torch_tables() -> dict[str, KernelTable]:
    """family -> its table, every entry filled."""
    return {
        "kda": KDAKernels(gate=ref.kda_gate, short_conv=short_conv.short_conv, chunked=kda_chunked.kda_chunked,
                          recurrent=kda_recurrent.kda_recurrent, rebuild_state=kda_rebuild.kda_rebuild_state,
                          decode_step=kda_decode.kda_decode_step),
        "mla": MLAKernels(prefill=ref.mla_prefill, decode=mla_decode.mla_decode),
        "indexer": IndexerKernels(quantize_keys=ref.indexer_quantize_keys,
                                  dequantize_keys=ref.indexer_dequantize_keys, scores=ref.indexer_scores,
                                  decode_scores=ref.indexer_decode_scores,
                                  paged_decode_scores=indexer_paged_decode.indexer_paged_decode_scores,
                                  topk=ref.indexer_topk, hadamard=hadamard.hadamard_transform),
        "moe": MoEKernels(router_logits=ref.router_logits, select_experts=ref.select_experts,
                          experts=moe_experts.experts_forward),
        "attn_res": AttnResKernels(step=ref.attn_res, mix=ref.attn_res_mix),
        "elementwise": ElementwiseKernels(rms_norm=ref.rms_norm, add_rms_norm=ref.add_rms_norm,
                                          gated_rms_norm=ref.gated_rms_norm,
                                          layer_norm=ref.layer_norm, l2_norm=ref.l2_norm,
                                          glu_activation=ref.glu_activation, sigmoid=ref.sigmoid),
        "lora": LoRAKernels(delta=ref.lora_delta, experts=ref.lora_experts_forward),
        "dense": DenseKernels(linear=dense.linear),
        "quant": QuantKernels(fp8_quantize=ref.fp8_quantize, fp8_dequantize=ref.fp8_dequantize,
                              mxfp4_quantize=ref.mxfp4_quantize, mxfp4_dequantize=ref.mxfp4_dequantize,
                              nvfp4_quantize=ref.nvfp4_quantize, nvfp4_dequantize=ref.nvfp4_dequantize),
    }
