"""Value types of the plugin contract: detection results, capabilities, kernel tables.

Kernel tables are frozen dataclasses of optional callables. Every callable has exactly the
signature of the reference op it replaces (docs/ops.md); a plugin fills only the entries it
really backs and leaves the rest None, and the facade falls back to the next plugin, finally
to the reference, entry by entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Detection:
    """What a platform plugin's `k3_detect_platform` found.

    name: platform name (`nvidia`, `amd`, `tpu`, `ppu`, `reference`, or a third party's).
    available: usable as found on this machine.
    reason: one sentence: what was found, or why it is unavailable (with the package and
        extra to install when an SDK is missing).
    forceable: `--platform NAME` may select it although it was not auto-detected (the PPU
        torch-native path runs on any torch device).
    priority: among several available platforms, the highest wins (ties are an error).
    device: the torch device string kernels run on ("cuda", "cpu", "xla"...).
    """

    name: str
    available: bool
    reason: str
    forceable: bool = False
    priority: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class PlatformInfo:
    """The selected platform, as every hook receives it."""

    name: str
    plugin: str              # registered plugin name that detected it
    distribution: str        # Python distribution shipping the plugin
    version: str
    device: str
    forced: bool             # selected by --platform / K3_PLATFORM without auto-detection


@dataclass(frozen=True)
class Capabilities:
    """What the selected device supports. Defaults say "unsupported": a plugin opts in with
    values read from the device. Conformance skips by capability, never by guess."""

    vendor: str = "unknown"
    arch: str = ""                       # e.g. "sm_90", "gfx942", "tpu-v7x"
    device_name: str = ""
    memory_bytes: int = 0
    device_count: int = 0
    dist_backend: str = "gloo"
    dtypes: frozenset[str] = frozenset({"float32", "float64"})   # activation dtypes
    fp8_dtype: str | None = None         # "e4m3fn" (OCP) or "e4m3fnuz" (gfx942), None: no fp8
    native_mxfp4: bool = False
    native_nvfp4: bool = False
    triton: bool = False
    graph_capture: bool = False
    symmetric_memory: bool = False
    hip_ipc: bool = False
    dcp: bool = False
    pd_transfer: bool = False
    cache_alignment_bytes: int = 1       # alignment the backing cache tensor's rows need

    REQUIREMENTS = ("bf16", "fp16", "fp64", "fp8", "mxfp4_native", "nvfp4_native", "triton", "graph_capture",
                    "symmetric_memory", "hip_ipc", "dcp", "pd_transfer", "multi_device")

    def has(self, requirement: str) -> bool:
        """True when the device meets a named requirement (see REQUIREMENTS)."""
        checks = {
            "bf16": "bfloat16" in self.dtypes, "fp16": "float16" in self.dtypes, "fp64": "float64" in self.dtypes,
            "fp8": self.fp8_dtype is not None, "mxfp4_native": self.native_mxfp4,
            "nvfp4_native": self.native_nvfp4, "triton": self.triton, "graph_capture": self.graph_capture,
            "symmetric_memory": self.symmetric_memory, "hip_ipc": self.hip_ipc, "dcp": self.dcp,
            "pd_transfer": self.pd_transfer, "multi_device": self.device_count >= 2,
        }
        if requirement not in checks:
            raise ValueError(f"unknown capability requirement {requirement!r}; known: {', '.join(self.REQUIREMENTS)}")
        return checks[requirement]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dtypes"] = sorted(self.dtypes)
        return out


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


class CollectiveBackend(Protocol):
    """One communication backend for a process group. The facade asks the backends in order
    and uses the first that `accepts` the operation on that tensor (torch.distributed last)."""

    name: str

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        """op: "all_reduce" or "all_gather"."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation along dim in rank order."""
