"""The kernel tables: one frozen dataclass of optional callables per kernel family.

A plugin's kernel hook returns its family's table with the entries it really backs and leaves
the rest None; the facade (`k3.platform`) merges the tables entry by entry (the first plugin in
hook order that fills an entry wins, the reference last) into one `KernelSet`, what the model
calls. Every entry's field names its protocol (`k3.plugin.kernels`: signature, shapes, dtypes,
ownership) and its oracle, the `k3.reference` op conformance compares it with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import kernels as p


class KernelTable:
    """Base of the kernel tables: a family name and entry-wise merging."""

    FAMILY = ""

    @classmethod
    def entries(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def provided(self) -> list[str]:
        return [name for name in self.entries() if getattr(self, name) is not None]


def _op(protocol: type, oracle: str):
    """A table field: an optional callable of `protocol`, checked against `k3.reference.<oracle>`."""
    return field(default=None, metadata={"protocol": protocol, "reference": oracle})


def entry_protocol(table: type[KernelTable], entry: str) -> type:
    """The protocol of one entry of a table."""
    return next(f for f in dataclasses.fields(table) if f.name == entry).metadata["protocol"]


def entry_oracle(table: type[KernelTable], entry: str) -> str:
    """The name of the `k3.reference` op that is one entry's oracle."""
    return next(f for f in dataclasses.fields(table) if f.name == entry).metadata["reference"]


@dataclass(frozen=True)
class KDAKernels(KernelTable):
    """Kimi Delta Attention (fla-core layout; states fp32 [N, HV, K, V])."""

    FAMILY = "kda"
    gate: p.KDAGate | None = _op(p.KDAGate, "kda_gate")
    short_conv: p.ShortConv | None = _op(p.ShortConv, "short_conv")
    chunked: p.KDAChunked | None = _op(p.KDAChunked, "kda_chunked")
    recurrent: p.KDARecurrent | None = _op(p.KDARecurrent, "kda_recurrent")
    rebuild_state: p.KDARebuildState | None = _op(p.KDARebuildState, "kda_rebuild_state")
    decode_step: p.KDADecodeStep | None = _op(p.KDADecodeStep, "kda_decode_step")


@dataclass(frozen=True)
class MLAKernels(KernelTable):
    """NoPE MLA over the latent cache: expanded prefill and absorbed paged decode (with DSA
    `topk_indices`)."""

    FAMILY = "mla"
    prefill: p.MLAPrefill | None = _op(p.MLAPrefill, "mla_prefill")
    decode: p.MLADecode | None = _op(p.MLADecode, "mla_decode")


@dataclass(frozen=True)
class IndexerKernels(KernelTable):
    """DSA lightning indexer: key quantisation, scores, exact top-k."""

    FAMILY = "indexer"
    quantize_keys: p.IndexerQuantizeKeys | None = _op(p.IndexerQuantizeKeys, "indexer_quantize_keys")
    dequantize_keys: p.IndexerDequantizeKeys | None = _op(p.IndexerDequantizeKeys, "indexer_dequantize_keys")
    scores: p.IndexerScores | None = _op(p.IndexerScores, "indexer_scores")
    decode_scores: p.IndexerDecodeScores | None = _op(p.IndexerDecodeScores, "indexer_decode_scores")
    paged_decode_scores: p.IndexerPagedDecodeScores | None = _op(p.IndexerPagedDecodeScores, "indexer_paged_decode_scores")
    topk: p.IndexerTopK | None = _op(p.IndexerTopK, "indexer_topk")
    hadamard: p.HadamardTransform | None = _op(p.HadamardTransform, "hadamard_transform")


@dataclass(frozen=True)
class MoEKernels(KernelTable):
    """Router and routed experts (dense or MXFP4 stacked weights)."""

    FAMILY = "moe"
    router_logits: p.RouterLogits | None = _op(p.RouterLogits, "router_logits")
    select_experts: p.SelectExperts | None = _op(p.SelectExperts, "select_experts")
    experts: p.Experts | None = _op(p.Experts, "experts_forward")


@dataclass(frozen=True)
class AttnResKernels(KernelTable):
    """Block Attention Residuals: the fused step and the plain mix."""

    FAMILY = "attn_res"
    step: p.AttnResStep | None = _op(p.AttnResStep, "attn_res")
    mix: p.AttnResMix | None = _op(p.AttnResMix, "attn_res_mix")


@dataclass(frozen=True)
class ElementwiseKernels(KernelTable):
    """Norms and activations."""

    FAMILY = "elementwise"
    rms_norm: p.RMSNorm | None = _op(p.RMSNorm, "rms_norm")
    add_rms_norm: p.AddRMSNorm | None = _op(p.AddRMSNorm, "add_rms_norm")
    gated_rms_norm: p.GatedRMSNorm | None = _op(p.GatedRMSNorm, "gated_rms_norm")
    layer_norm: p.LayerNorm | None = _op(p.LayerNorm, "layer_norm")
    l2_norm: p.L2Norm | None = _op(p.L2Norm, "l2_norm")
    glu_activation: p.GLUActivation | None = _op(p.GLUActivation, "glu_activation")
    sigmoid: p.Sigmoid | None = _op(p.Sigmoid, "sigmoid")


@dataclass(frozen=True)
class QuantKernels(KernelTable):
    """Codecs for quantised cache pages and weights."""

    FAMILY = "quant"
    fp8_quantize: p.FP8Quantize | None = _op(p.FP8Quantize, "fp8_quantize")
    fp8_dequantize: p.FP8Dequantize | None = _op(p.FP8Dequantize, "fp8_dequantize")
    mxfp4_quantize: p.MXFP4Quantize | None = _op(p.MXFP4Quantize, "mxfp4_quantize")
    mxfp4_dequantize: p.MXFP4Dequantize | None = _op(p.MXFP4Dequantize, "mxfp4_dequantize")
    nvfp4_quantize: p.NVFP4Quantize | None = _op(p.NVFP4Quantize, "nvfp4_quantize")
    nvfp4_dequantize: p.NVFP4Dequantize | None = _op(p.NVFP4Dequantize, "nvfp4_dequantize")


@dataclass(frozen=True)
class LoRAKernels(KernelTable):
    """LoRA adapters of a multi-adapter batch: the per-row delta of a product, the routed experts
    with per-expert adapters."""

    FAMILY = "lora"
    delta: p.LoRADelta | None = _op(p.LoRADelta, "lora_delta")
    experts: p.LoRAExperts | None = _op(p.LoRAExperts, "lora_experts_forward")


@dataclass(frozen=True)
class DenseKernels(KernelTable):
    """The graph's dense products (projections, LM head)."""

    FAMILY = "dense"
    linear: p.Linear | None = _op(p.Linear, "linear")


KERNEL_TABLES: tuple[type[KernelTable], ...] = (
    KDAKernels, MLAKernels, IndexerKernels, MoEKernels, AttnResKernels, ElementwiseKernels, QuantKernels,
    LoRAKernels, DenseKernels)


@dataclass(frozen=True)
class KernelSet:
    """Every kernel family, fully resolved (no None entry): what the model calls."""

    kda: KDAKernels
    mla: MLAKernels
    indexer: IndexerKernels
    moe: MoEKernels
    attn_res: AttnResKernels
    elementwise: ElementwiseKernels
    quant: QuantKernels
    lora: LoRAKernels
    dense: DenseKernels
    providers: dict[str, str] = field(default_factory=dict, compare=False)   # "kda.chunked" -> plugin
    # resolved for the batch-invariant mode (every entry marked): the model then runs decode and
    # prefill through the same entries (docs/batch-invariance.md)
    batch_invariant: bool = field(default=False, compare=False)
