"""The batch-invariant kernel set: every entry of every table (`invariant_tables`).

Entries whose torch kernels are already row by row and exact serve unchanged: the key and
number-format codecs (block amax, power-of-two scales, exact casts), the Hadamard rotation
(additions and one power-of-two scale) and the indexer's top-k (a stable sort: ties to the lower
position). The rest are this package's.
"""

from __future__ import annotations

import functools

from k3 import reference as ref
from k3.plugin.tables import (AttnResKernels, DenseKernels, ElementwiseKernels, IndexerKernels, KDAKernels,
                              KernelTable, LoRAKernels, MLAKernels, MoEKernels, QuantKernels)

from .. import hadamard
from k3.ops_helpers import invariant

from . import attn_res, elementwise, indexer, kda, lora, mla, moe


@functools.cache
def invariant_tables() -> dict[str, KernelTable]:
    """family -> its batch-invariant table, every entry filled (unmarked: the platform marks)."""
    return {
        "kda": KDAKernels(gate=kda.gate, short_conv=kda.short_conv, chunked=kda.chunked, recurrent=kda.recurrent,
                          rebuild_state=kda.rebuild_state, decode_step=kda.decode_step),
        "mla": MLAKernels(prefill=mla.prefill, decode=mla.decode),
        "indexer": IndexerKernels(quantize_keys=ref.indexer_quantize_keys, dequantize_keys=ref.indexer_dequantize_keys,
                                  scores=indexer.scores, decode_scores=indexer.decode_scores,
                                  paged_decode_scores=indexer.paged_decode_scores, topk=ref.indexer_topk,
                                  hadamard=hadamard.hadamard_transform),
        "moe": MoEKernels(router_logits=moe.router_logits, select_experts=moe.select_experts, experts=moe.experts),
        "attn_res": AttnResKernels(step=attn_res.step, mix=attn_res.mix),
        "elementwise": ElementwiseKernels(rms_norm=elementwise.rms_norm, add_rms_norm=elementwise.add_rms_norm,
                                          gated_rms_norm=elementwise.gated_rms_norm,
                                          layer_norm=elementwise.layer_norm, l2_norm=elementwise.l2_norm,
                                          glu_activation=elementwise.glu_activation, sigmoid=elementwise.sigmoid),
        "quant": QuantKernels(fp8_quantize=ref.fp8_quantize, fp8_dequantize=ref.fp8_dequantize,
                              mxfp4_quantize=ref.mxfp4_quantize, mxfp4_dequantize=ref.mxfp4_dequantize,
                              nvfp4_quantize=ref.nvfp4_quantize, nvfp4_dequantize=ref.nvfp4_dequantize),
        "lora": LoRAKernels(delta=lora.delta, experts=lora.experts),
        "dense": DenseKernels(linear=invariant.linear),
    }
