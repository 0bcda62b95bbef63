"""AMD detection: a ROCm build of torch (`torch.version.hip`) that sees a GPU. Without one, the
platform is forceable on the CPU only when K3_AMD_SIMULATE names a gfx target (simulate.py)."""

from __future__ import annotations

from k3.plugin.types import Detection

NAME = "amd"
PRIORITY = 30                 # never available together with nvidia (one torch build)
INSTALL = "`pip install 'k3[amd]'`"


def unavailable(reason: str) -> Detection:
    """Not available here; forceable on the CPU (a simulated target) when K3_AMD_SIMULATE is set."""
    from .simulate import ENV, requested_arch

    try:
        arch = requested_arch()
    except ValueError as e:
        return Detection(NAME, False, f"{reason}; {ENV}: {e}", priority=PRIORITY, device="cuda")
    if arch:
        return Detection(NAME, False, f"{reason}; {ENV}={arch}: `--platform amd` simulates {arch} on the CPU "
                         "(reference ops, and the Triton kernels under TRITON_INTERPRET=1; nothing runs on AMD "
                         "hardware)", forceable=True, priority=PRIORITY, device="cpu")
    return Detection(NAME, False, reason, priority=PRIORITY, device="cuda")


def detect() -> Detection:
    import torch

    from k3.platforms._probe import cuda_device_names, torch_build

    if not torch.version.hip:
        return unavailable(f"{torch_build()} is not a ROCm build; install torch from the ROCm wheel index, "
                           f"then {INSTALL}")
    try:
        names = cuda_device_names()
    except Exception as e:       # a driver or runtime that fails to initialise
        return unavailable(f"{torch_build()} failed to list devices ({type(e).__name__}: {e})")
    if not names:
        return unavailable(f"{torch_build()} sees no AMD GPU (check /dev/kfd access, rocm-smi and "
                           "HIP_VISIBLE_DEVICES)")
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    return Detection(NAME, True, f"{len(names)} x {names[0]} ({arch}) with {torch_build()}",
                     priority=PRIORITY, device="cuda")
