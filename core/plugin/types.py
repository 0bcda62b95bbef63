"""Value types of the plugin contract: detection results, the selected platform, capabilities,
collective backends and the KDA state-row layouts. The kernel tables are in `tables.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch


# What `k3_kda_state_layout` may answer: "hkv" (canonical [H, K, V] per row) or "hvk" (each
# head stored transposed, [H, V, K]).
KDA_STATE_LAYOUTS = ("hkv", "hvk")


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
class ShapeBuckets:
    """Static shapes a platform compiles for (`k3_shape_buckets`): the engine pads every step
    to them, so a compiling backend (XLA) sees one graph per bucket instead of one per shape.

    batch:  sequence-count buckets, ascending (a step of N sequences runs as the smallest
            bucket >= N; past the largest, the next multiple of it).
    tokens: token-count buckets (a step's packed new tokens, so the prefill-chunk length),
            ascending, the same rule.
    Padding sequences run on a scratch row the engine reserves (fresh KDA state, their
    latents and index keys written into and read from that row only) and their logits are
    dropped, so they never touch a request's rows.
    """

    batch: tuple[int, ...]
    tokens: tuple[int, ...]

    def __post_init__(self):
        for name in ("batch", "tokens"):
            sizes = getattr(self, name)
            if not sizes or any(int(s) < 1 for s in sizes):
                raise ValueError(f"ShapeBuckets.{name} must be positive sizes, got {sizes!r}")
            object.__setattr__(self, name, tuple(sorted(set(int(s) for s in sizes))))

    @staticmethod
    def _pick(sizes: tuple[int, ...], n: int) -> int:
        for size in sizes:
            if size >= n:
                return size
        return -(-n // sizes[-1]) * sizes[-1]

    def batch_for(self, n: int) -> int:
        """The bucket of n sequences."""
        return self._pick(self.batch, n)

    def tokens_for(self, n: int) -> int:
        """The bucket of n packed tokens."""
        return self._pick(self.tokens, n)


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
    aiter: bool = False                  # AMD's AITER fused ops serve (imports on a ROCm device, opted in)
    dcp: bool = False
    pd_transfer: bool = False
    cache_alignment_bytes: int = 1       # alignment the backing cache tensor's rows need
    # the device cannot write through dtype-reinterpreting views of one byte tensor (XLA's
    # functional tensors execute the pending graph at each such write): the cache pool keeps
    # every region as a tensor of its own dtype, indexed by the same rows (`k3.cache.pool`)
    typed_cache_regions: bool = False

    REQUIREMENTS = ("bf16", "fp16", "fp64", "fp8", "mxfp4_native", "nvfp4_native", "triton", "graph_capture",
                    "symmetric_memory", "hip_ipc", "aiter", "dcp", "pd_transfer", "multi_device")

    def has(self, requirement: str) -> bool:
        """True when the device meets a named requirement (see REQUIREMENTS)."""
        checks = {
            "bf16": "bfloat16" in self.dtypes, "fp16": "float16" in self.dtypes, "fp64": "float64" in self.dtypes,
            "fp8": self.fp8_dtype is not None, "mxfp4_native": self.native_mxfp4,
            "nvfp4_native": self.native_nvfp4, "triton": self.triton, "graph_capture": self.graph_capture,
            "symmetric_memory": self.symmetric_memory, "hip_ipc": self.hip_ipc, "aiter": self.aiter, "dcp": self.dcp,
            "pd_transfer": self.pd_transfer, "multi_device": self.device_count >= 2,
        }
        if requirement not in checks:
            raise ValueError(f"unknown capability requirement {requirement!r}; known: {', '.join(self.REQUIREMENTS)}")
        return checks[requirement]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dtypes"] = sorted(self.dtypes)
        return out


class CollectiveBackend(Protocol):
    """One communication backend for a process group. The facade asks the backends in order
    and uses the first that `accepts` the operation on that tensor (torch.distributed last)."""

    name: str

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        """op: "all_reduce", "all_gather" or "all_to_all_single" (expert-parallel dispatch);
        a backend declines the ops it does not implement."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation along dim in rank order."""

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes=None, input_split_sizes=None) -> torch.Tensor:
        """x [N, ...] cut along dim 0, input_split_sizes[r] rows sent to rank r (None: N / world
        each); returns the rows received, concatenated in rank order: [sum(output_split_sizes),
        ...] (None: x's shape). Split sizes: host ints, or an int tensor of world counts that a
        backend may use on the device (`k3.model.parallel.Collectives.all_to_all_single`).
        Optional: a backend without this method is passed over for it."""
