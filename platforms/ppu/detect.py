"""T-HEAD PPU detection: a CUDA-compatible torch device whose name marks it as a PPU.

The PPU runs the torch-native path (the reference ops on a "cuda" torch device, no Triton),
so the platform is forceable: `--platform ppu` runs that path on any torch device ("cuda"
when torch.cuda is available, else "cpu"). Nothing beyond torch is imported.
"""

from __future__ import annotations

from k3.plugin.types import Detection

NAME = "ppu"
PRIORITY = 40                 # above nvidia: a PPU also answers torch.cuda's questions
# Substrings (upper case) of the device names T-HEAD's torch build reports (Zhenwu PPU
# M890 / 810E).
NAME_MARKERS = ("PPU", "ZHENWU", "T-HEAD", "THEAD")


def is_ppu_name(device_name: str) -> bool:
    """True when a torch.cuda device name is a T-HEAD PPU's."""
    upper = device_name.upper()
    return any(marker in upper for marker in NAME_MARKERS)


def detect() -> Detection:
    from k3.platforms._probe import cuda_device_names, torch_build

    try:
        names = cuda_device_names()
    except Exception:            # a failing runtime: no PPU, the CPU path stays forceable
        names = []
    device = "cuda" if names else "cpu"
    ppus = [n for n in names if is_ppu_name(n)]
    if ppus:
        return Detection(NAME, True, f"{len(ppus)} x {ppus[0]} through {torch_build()}; torch-native path, "
                         "no Triton", forceable=True, priority=PRIORITY, device=device)
    found = f"the CUDA device is a {names[0]}, not a T-HEAD PPU" if names else \
        f"{torch_build()} sees no CUDA-compatible device"
    return Detection(NAME, False, f"no T-HEAD PPU: {found}; `--platform ppu` runs the torch-native path on "
                     f"the {device} anyway", forceable=True, priority=PRIORITY, device=device)
