"""k3.plugin: the vendor contract, and nothing else.

What a plugin implements against: the pluggy markers (`hookimpl`, `hookspec`, the hookspec
version), the hook specifications (`k3.plugin.hookspecs`), the value types (Detection,
PlatformInfo, Capabilities, CollectiveBackend) and the kernel tables. The machinery that
discovers plugins, selects a platform and resolves its kernels is `k3.platform`; this package
imports nothing of k3 above the number formats (see docs/architecture.md, "Layers").

Vendors implement hooks from `k3.plugin.hookspecs` with `@k3.hookimpl` and register the module
under the `k3` entry-point group; see docs/plugins.md.
"""

from .markers import HOOKSPEC_VERSION, batch_invariant, hookimpl, hookspec, is_batch_invariant
from .tables import (
    KERNEL_TABLES,
    AttnResKernels,
    DenseKernels,
    ElementwiseKernels,
    IndexerKernels,
    KDAKernels,
    KernelSet,
    KernelTable,
    LoRAKernels,
    MLAKernels,
    MoEKernels,
    QuantKernels,
)
from .types import KDA_STATE_LAYOUTS, Capabilities, CollectiveBackend, Detection, PlatformInfo

__all__ = [
    "HOOKSPEC_VERSION", "KDA_STATE_LAYOUTS", "KERNEL_TABLES", "AttnResKernels", "Capabilities",
    "CollectiveBackend", "DenseKernels", "Detection", "ElementwiseKernels", "IndexerKernels", "KDAKernels", "KernelSet",
    "KernelTable", "LoRAKernels", "MLAKernels", "MoEKernels", "PlatformInfo", "QuantKernels", "batch_invariant",
    "hookimpl", "hookspec", "is_batch_invariant",
]
