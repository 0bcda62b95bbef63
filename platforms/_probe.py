"""Cheap probes shared by the platform detectors.

Detection must stay cheap: these helpers look packages up (`importlib.util.find_spec`,
distribution metadata) without importing them, and describe the installed torch build.
torch itself is a core dependency, so importing it inside a probe is fine; vendor SDKs
(triton, torch_xla, aiter...) are never imported here.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version


def has_module(name: str) -> bool:
    """True when `import name` would find the module (nothing is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # a parent package that fails, or a broken __spec__
        return False


def dist_version(distribution: str) -> str | None:
    """Installed version of a distribution, or None."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def torch_build() -> str:
    """The torch build in words, e.g. "torch 2.13.0+cpu (a CPU-only build)"."""
    import torch

    if torch.version.hip:
        return f"torch {torch.__version__} (ROCm/HIP {torch.version.hip})"
    if torch.version.cuda:
        return f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    return f"torch {torch.__version__} (a CPU-only build)"


def cuda_device_names() -> list[str]:
    """Names of the devices torch.cuda sees (CUDA, ROCm and CUDA-compatible builds); empty when
    none. Queries device properties, which initialises the torch.cuda runtime in this process."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
