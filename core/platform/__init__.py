"""k3.platform: plugin discovery, platform selection and the typed facade the core calls.

`select_platform()` registers the reference plugin and every `k3` entry point
(`discovery`), picks the platform (`selection`) and returns a `Platform` (`facade`): its
capabilities, its kernels resolved once into plain callables, its collectives, cache
allocation and serving defaults. Nothing outside this package calls a hook. The contract the
plugins implement is `k3.plugin`.
"""

from .collectives import DispatchingCollectives, TorchDistributedBackend
from .discovery import Discovery, PluginRecord, discover
from .facade import BatchInvariantUnsupported, Platform, select_platform
from .selection import PlatformError, select

__all__ = ["BatchInvariantUnsupported", "Discovery", "DispatchingCollectives", "Platform", "PlatformError", "PluginRecord",
           "TorchDistributedBackend", "discover", "select", "select_platform"]
