"""NVIDIA detection: a CUDA build of torch that sees a CUDA device (not a T-HEAD PPU), and
triton. triton is only looked up, never imported; torch.cuda is asked for device names.
"""

from __future__ import annotations

from k3.plugin.types import Detection

NAME = "nvidia"
PRIORITY = 30
INSTALL = "`pip install 'k3[nvidia]'`"


def unavailable(reason: str) -> Detection:
    return Detection(NAME, False, reason, priority=PRIORITY, device="cuda")


def detect() -> Detection:
    import torch

    from k3.platforms._probe import cuda_device_names, dist_version, has_module, torch_build
    from k3.platforms.ppu.detect import is_ppu_name

    if torch.version.hip:
        return unavailable(f"{torch_build()} is a ROCm build, not a CUDA one (the amd platform serves AMD "
                           f"GPUs); for NVIDIA GPUs install a CUDA build of torch, then {INSTALL}")
    if not torch.version.cuda:
        return unavailable(f"{torch_build()} has no CUDA support; install a CUDA build of torch, then "
                           f"{INSTALL} for triton")
    try:
        names = cuda_device_names()
    except Exception as e:       # a driver or runtime that fails to initialise
        return unavailable(f"{torch_build()} failed to list CUDA devices ({type(e).__name__}: {e})")
    if not names:
        return unavailable(f"{torch_build()} sees no CUDA device (check the driver with nvidia-smi and "
                           "CUDA_VISIBLE_DEVICES)")
    if is_ppu_name(names[0]):
        return unavailable(f"the CUDA device is a T-HEAD PPU ({names[0]}), which the ppu platform serves")
    if not has_module("triton"):
        return unavailable(f"triton is not installed ({len(names)} x {names[0]} found); {INSTALL} installs it")
    major, minor = torch.cuda.get_device_capability(0)
    return Detection(NAME, True, f"{len(names)} x {names[0]} (sm_{major}{minor}) with {torch_build()} and "
                     f"triton {dist_version('triton') or '(version unknown)'}", priority=PRIORITY, device="cuda")
