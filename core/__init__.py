"""k3: serving stack for Kimi K3-architecture models."""
__version__ = "0.1.0"


def __getattr__(name):
    # `k3.hookimpl` for plugin authors, without importing the plugin machinery on `import k3`.
    if name == "hookimpl":
        from .plugin.markers import hookimpl

        return hookimpl
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
