"""The XLA kernel tables the tpu platform serves: every kernel entry of k3 (docs/ops.md), each one XLA-clean:
it traces into an XLA graph with static shapes, no host read of a device value, no
data-dependent shape and no op torch-xla 2.9 runs on the CPU (checked entry by entry on PJRT's
CPU device with torch-xla's metrics by tests/tpu/test_xla_kernels.py and by
`k3 conformance --platform tpu`; docs/kernel-contract.md, section (a)).

Three kinds of entries:
- kernels of this package, written for XLA where the reference platform's read the host:
  KDA chunked prefill as a fixed-chunk scan (`kda_chunked.py`), the packed forms of the KDA
  recurrence and short conv (`kda_recurrent.py`, `short_conv.py`), MLA prefill and the
  indexer's prefill scores with masks from `cu_seqlens` on the device (`mla_prefill.py`,
  `indexer_scores.py`), the MXFP4 / NVFP4 quantisers and the index-key quantiser without
  `frexp` / `signbit` (`quant.py`), the LoRA experts and the MoE experts with the dense
  dispatch (`lora_experts.py`, `experts_dense` here);
- the reference platform's torch kernels that are XLA-clean as they are
  (`k3.platforms.torch_kernels`: decode-path KDA, MLA decode, paged index scores, rebuild_state,
  Hadamard, dense.linear);
- `k3.reference` ops that are XLA-clean as they are (norms, activations, router, AttnRes, the
  fp8 quantiser, the dequantisers, LoRA delta, the indexer's decode scores and key dequantiser).

The conformance report names the function that serves each entry (its `implementation`).
"""

from __future__ import annotations

from k3 import reference as ref
from k3.platforms.torch_kernels import moe_experts
from k3.platforms.torch_kernels.tables import torch_tables
from k3.plugin.tables import (AttnResKernels, DenseKernels, ElementwiseKernels, IndexerKernels, KDAKernels,
                              LoRAKernels, MLAKernels, MoEKernels, QuantKernels)

from . import indexer_scores, kda_chunked, kda_recurrent, lora_experts, mla_prefill, quant, short_conv


def experts_dense(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                  dense_dispatch=True):
    """`Experts` with the dense dispatch always (static shapes, no host read); `dense_dispatch`
    is accepted and ignored: both dispatches compute the same function."""
    return moe_experts.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                       linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=True)


def _pick(table_type, family: str, entries: tuple[str, ...], **own):
    """A `table_type` with `entries` taken from the pure-torch kernel set, plus `own` entries."""
    base = torch_tables()[family]
    return table_type(**{e: getattr(base, e) for e in entries}, **own)


def kda_table() -> KDAKernels:
    """Gate, decode step and rebuild_state as the torch kernels; the chunked prefill as a
    fixed-chunk scan; short conv and the recurrence without host reads of `cu_seqlens`."""
    return _pick(KDAKernels, "kda", ("gate", "decode_step", "rebuild_state"), chunked=kda_chunked.kda_chunked,
                 short_conv=short_conv.short_conv, recurrent=kda_recurrent.kda_recurrent)


def mla_table() -> MLAKernels:
    """The absorbed paged decode (masks by seq_lens) and the masked prefill."""
    return _pick(MLAKernels, "mla", ("decode",), prefill=mla_prefill.mla_prefill)


def indexer_table() -> IndexerKernels:
    """Every indexer entry: prefill scores by position under masks, decode scores, exact
    top-k (torch.topk: static k), the key codecs, the Hadamard rotation."""
    return _pick(IndexerKernels, "indexer", ("paged_decode_scores", "topk", "hadamard", "dequantize_keys",
                                             "decode_scores"),
                 scores=indexer_scores.indexer_scores, quantize_keys=quant.indexer_quantize_keys)


def moe_table() -> MoEKernels:
    """Router logits, top-k selection and the dense-dispatch experts."""
    return _pick(MoEKernels, "moe", ("router_logits", "select_experts"), experts=experts_dense)


def attn_res_table() -> AttnResKernels:
    """Block Attention Residuals (plain torch reductions)."""
    return _pick(AttnResKernels, "attn_res", ("step", "mix"))


def elementwise_table() -> ElementwiseKernels:
    """Norms and activations (plain torch)."""
    return _pick(ElementwiseKernels, "elementwise", ("rms_norm", "add_rms_norm", "gated_rms_norm", "layer_norm",
                                                     "l2_norm", "glu_activation", "sigmoid"))


def quant_table() -> QuantKernels:
    """`k3.quant`'s codecs as they are, but for the MXFP4 quantiser of `quant.py` (no `frexp`)."""
    return QuantKernels(fp8_quantize=ref.fp8_quantize, fp8_dequantize=ref.fp8_dequantize,
                        mxfp4_quantize=quant.mxfp4_quantize, mxfp4_dequantize=ref.mxfp4_dequantize,
                        nvfp4_quantize=ref.nvfp4_quantize, nvfp4_dequantize=ref.nvfp4_dequantize)


def lora_table() -> LoRAKernels:
    """The LoRA delta (one shrink and expand per slot, masked) and the dense-dispatch experts."""
    return LoRAKernels(delta=ref.lora_delta, experts=lora_experts.lora_experts)


def dense_table() -> DenseKernels:
    """The graph's products (the torch kernel: one matmul)."""
    return _pick(DenseKernels, "dense", ("linear",))


TABLES = {"kda": kda_table, "mla": mla_table, "indexer": indexer_table, "moe": moe_table,
          "attn_res": attn_res_table, "elementwise": elementwise_table, "quant": quant_table,
          "lora": lora_table, "dense": dense_table}
