"""Portable Triton kernels shared by the GPU plugins (NVIDIA now; AMD's Triton path later).

Importing this package does not import Triton: each kernel module does, and a plugin imports
a kernel module only after its platform has been selected and Triton found. Every kernel has
its entry's protocol (`k3.plugin.kernels`), hands inputs it does not cover (float64, shapes
outside its constraints) to the reference platform's torch kernel for the entry
(`k3.platforms.torch_kernels`), or to the reference op where the reference platform serves
that, and runs under `TRITON_INTERPRET=1` on CPU tensors so CI checks it at tiny shapes
against the reference.
"""

import os


def interpreted() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET set and not "0"): kernels then run
    on CPU tensors, without the GPU-only paths (dot_scaled, cuBLAS)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
