"""The simulated AMD platform: `K3_AMD_SIMULATE=gfx950` (or gfx942) makes `--platform amd`
forceable on a machine without a ROCm GPU. The plugin then serves the same kernels with that
target's launch configurations (archs.py) on the CPU, the Triton ones through Triton's
interpreter (TRITON_INTERPRET=1, which a simulated run needs: without it the Triton entries go
back to the reference ops, see `triton_runs`), with the interpreter corrected to round and
multiply bf16 as the GPUs do (k3.platforms.triton_kernels.interpreter_fidelity, as the kernel
tests do). This checks the launch configurations' numerics and the plugin's wiring, never AMD
code generation or hardware."""

from __future__ import annotations

import os

from k3.platforms.triton_kernels import interpreted

ENV = "K3_AMD_SIMULATE"


def requested_arch() -> str | None:
    """The gfx target K3_AMD_SIMULATE names ("" or unset: no simulation). A name outside the
    launch table raises ValueError (archs.arch)."""
    from . import archs

    name = os.environ.get(ENV, "").strip()
    return archs.arch(name).name if name else None


def triton_runs(device: str) -> bool:
    """Whether the Triton kernels can run on `device`: the ROCm device ("cuda"), or any device
    under the Triton interpreter (then corrected once: interpreter_fidelity.apply)."""
    if device == "cuda":
        return True
    if not interpreted():
        return False
    from k3.platforms.triton_kernels import interpreter_fidelity

    interpreter_fidelity.apply()
    return True
