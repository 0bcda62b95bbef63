"""TPU detection: torch-xla (with libtpu) in a torch it was built for, and TPU chips on the
host. Nothing is imported: packages are looked up, and the chips are device nodes
(/dev/accel* on TPU v2-v4, /dev/vfio/<n> on v5e and later). Initialising PJRT would be slow
and would claim the chips, so it waits for `k3_capabilities` on the selected platform.

With torch-xla installed and `PJRT_DEVICE=CPU`, the platform is not detected (no TPU) but is
forceable: `--platform tpu` runs k3 through XLA on PJRT's CPU device (the CI tier, issue 24).
"""

from __future__ import annotations

import glob
import os

from k3.plugin.types import Detection

NAME = "tpu"
PRIORITY = 20
INSTALL = "`pip install 'k3[tpu]'` in its own environment (torch-xla 2.9 needs torch 2.9)"


def unavailable(reason: str) -> Detection:
    return Detection(NAME, False, reason, priority=PRIORITY, device="xla")


def tpu_device_nodes() -> list[str]:
    """Device nodes of TPU chips on this host."""
    vfio = [p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit()]
    return sorted(glob.glob("/dev/accel[0-9]*") + vfio)


def detect() -> Detection:
    import torch

    from k3.platforms._probe import dist_version, has_module

    xla = dist_version("torch-xla") or dist_version("torch_xla")
    if not xla or not has_module("torch_xla"):
        return unavailable(f"torch_xla is not installed (this environment has torch {torch.__version__}); {INSTALL}")
    torch_mm, xla_mm = torch.__version__.split("+")[0].split(".")[:2], xla.split("+")[0].split(".")[:2]
    if torch_mm != xla_mm:
        return unavailable(f"torch-xla {xla} needs torch {'.'.join(xla_mm)}, but torch {torch.__version__} is "
                           f"installed; {INSTALL}")
    pjrt = os.environ.get("PJRT_DEVICE", "")
    if pjrt.upper() == "CPU":
        return Detection(NAME, False, f"PJRT_DEVICE=CPU selects PJRT's CPU device, not a TPU; `--platform tpu` "
                         f"runs through XLA on it (torch-xla {xla})", forceable=True, priority=PRIORITY,
                         device="xla")
    if pjrt and pjrt.upper() != "TPU":
        return unavailable(f"PJRT_DEVICE={pjrt} selects PJRT's {pjrt} device, not a TPU (unset it, or set "
                           "PJRT_DEVICE=TPU on a TPU host; PJRT_DEVICE=CPU makes `--platform tpu` forceable)")
    if not has_module("libtpu"):
        return unavailable(f"torch-xla {xla} is installed without libtpu, which TPUs need; "
                           f"`pip install 'torch-xla[tpu]=={xla}'`")
    nodes = tpu_device_nodes()
    if not nodes:
        return unavailable(f"torch-xla {xla} is installed but this host has no TPU chip (no /dev/accel* or "
                           "/dev/vfio/<n> device)")
    return Detection(NAME, True, f"{len(nodes)} TPU chip device node(s) with torch-xla {xla} and libtpu "
                     f"{dist_version('libtpu') or '(version unknown)'}", priority=PRIORITY, device="xla")
