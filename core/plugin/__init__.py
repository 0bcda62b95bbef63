"""k3.plugin: the plugin contract (pluggy hookspecs, types, forward metadata, cache views)
and the facade that selects a platform and resolves its kernels.

Vendors implement hooks from `k3.plugin.hookspecs` with `@k3.hookimpl` and register the module
under the `k3` entry-point group; see docs/plugins.md.
"""

from .contract import CacheViews, ForwardMetadata, IndexKeyCacheView, KDAStateView, LatentCacheView
from .facade import DispatchingCollectives, Platform, select_platform
from .manager import PlatformError
from .markers import HOOKSPEC_VERSION, hookimpl, hookspec
from .types import (
    KERNEL_TABLES,
    AttnResKernels,
    Capabilities,
    CollectiveBackend,
    Detection,
    ElementwiseKernels,
    IndexerKernels,
    KDAKernels,
    KernelSet,
    MLAKernels,
    MoEKernels,
    PlatformInfo,
    QuantKernels,
)

__all__ = [
    "HOOKSPEC_VERSION", "KERNEL_TABLES", "AttnResKernels", "CacheViews", "Capabilities", "CollectiveBackend",
    "Detection", "DispatchingCollectives", "ElementwiseKernels", "ForwardMetadata", "IndexKeyCacheView",
    "IndexerKernels", "KDAKernels", "KDAStateView", "KernelSet", "LatentCacheView", "MLAKernels", "MoEKernels",
    "Platform", "PlatformError", "PlatformInfo", "QuantKernels", "hookimpl", "hookspec", "select_platform",
]
