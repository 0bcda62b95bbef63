"""The kernel tables: one frozen dataclass of optional callables per kernel family.

A plugin's kernel hook returns its family's table with the entries it really backs and leaves
the rest None; the facade (`k3.platform`) merges the tables entry by entry (the first plugin in
hook order that fills an entry wins, the reference last) into one `KernelSet`, what the model
calls. Every entry has exactly the signature of its reference op (docs/ops.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field


class KernelTable:
    """Base of the kernel tables: a family name and entry-wise merging."""

    FAMILY = ""

    @classmethod
    def entries(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def provided(self) -> list[str]:
        return [name for name in self.entries() if getattr(self, name) is not None]


def _op(doc: str):
    return field(default=None, metadata={"reference": doc})


@dataclass(frozen=True)
class KDAKernels(KernelTable):
    """Kimi Delta Attention (fla-core layout; states fp32 [N, HV, K, V])."""

    FAMILY = "kda"
    gate: Callable | None = _op("k3.reference.kda_gate")
    short_conv: Callable | None = _op("k3.reference.short_conv")
    chunked: Callable | None = _op("k3.reference.kda_chunked")
    recurrent: Callable | None = _op("k3.reference.kda_recurrent")
    rebuild_state: Callable | None = _op("k3.reference.kda_rebuild_state")
    decode_step: Callable | None = _op("k3.reference.kda_decode_step")


@dataclass(frozen=True)
class MLAKernels(KernelTable):
    """NoPE MLA over the latent cache: expanded prefill and absorbed paged decode (with DSA
    `topk_indices`)."""

    FAMILY = "mla"
    prefill: Callable | None = _op("k3.reference.mla_prefill")
    decode: Callable | None = _op("k3.reference.mla_decode")


@dataclass(frozen=True)
class IndexerKernels(KernelTable):
    """DSA lightning indexer: key quantisation, scores, exact top-k."""

    FAMILY = "indexer"
    quantize_keys: Callable | None = _op("k3.reference.indexer_quantize_keys")
    dequantize_keys: Callable | None = _op("k3.reference.indexer_dequantize_keys")
    scores: Callable | None = _op("k3.reference.indexer_scores")
    decode_scores: Callable | None = _op("k3.reference.indexer_decode_scores")
    paged_decode_scores: Callable | None = _op("k3.reference.indexer_paged_decode_scores")
    topk: Callable | None = _op("k3.reference.indexer_topk")
    hadamard: Callable | None = _op("k3.reference.hadamard_transform")


@dataclass(frozen=True)
class MoEKernels(KernelTable):
    """Router and routed experts (dense or MXFP4 stacked weights)."""

    FAMILY = "moe"
    router_logits: Callable | None = _op("k3.reference.router_logits")
    select_experts: Callable | None = _op("k3.reference.select_experts")
    experts: Callable | None = _op("k3.reference.experts_forward")


@dataclass(frozen=True)
class AttnResKernels(KernelTable):
    """Block Attention Residuals: the fused step and the plain mix."""

    FAMILY = "attn_res"
    step: Callable | None = _op("k3.reference.attn_res")
    mix: Callable | None = _op("k3.reference.attn_res_mix")


@dataclass(frozen=True)
class ElementwiseKernels(KernelTable):
    """Norms and activations."""

    FAMILY = "elementwise"
    rms_norm: Callable | None = _op("k3.reference.rms_norm")
    gated_rms_norm: Callable | None = _op("k3.reference.gated_rms_norm")
    layer_norm: Callable | None = _op("k3.reference.layer_norm")
    l2_norm: Callable | None = _op("k3.reference.l2_norm")
    glu_activation: Callable | None = _op("k3.reference.glu_activation")


@dataclass(frozen=True)
class QuantKernels(KernelTable):
    """Codecs for quantised cache pages and weights."""

    FAMILY = "quant"
    fp8_quantize: Callable | None = _op("k3.reference.fp8_quantize")
    fp8_dequantize: Callable | None = _op("k3.reference.fp8_dequantize")
    mxfp4_quantize: Callable | None = _op("k3.reference.mxfp4_quantize")
    mxfp4_dequantize: Callable | None = _op("k3.reference.mxfp4_dequantize")
    nvfp4_quantize: Callable | None = _op("k3.reference.nvfp4_quantize")
    nvfp4_dequantize: Callable | None = _op("k3.reference.nvfp4_dequantize")


KERNEL_TABLES: tuple[type[KernelTable], ...] = (
    KDAKernels, MLAKernels, IndexerKernels, MoEKernels, AttnResKernels, ElementwiseKernels, QuantKernels)


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
    providers: dict[str, str] = field(default_factory=dict, compare=False)   # "kda.chunked" -> plugin
