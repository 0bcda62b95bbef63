"""k3: serving stack for Kimi K3-architecture models."""
__version__ = "0.1.0"


def __getattr__(name):
    # `k3.LLM`, `k3.SamplingParams`, `k3.StructuredOutputsParams` and `k3.hookimpl` without importing the engine or the
    # plugin machinery on `import k3`.
    if name == "hookimpl":
        from .plugin.markers import hookimpl

        return hookimpl
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from .structured.spec import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
