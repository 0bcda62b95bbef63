"""What a torch device supports for the torch-native kernels, decided once at set-up (never by
trying per call): torch._grouped_mm, and torch.compile (inductor's GPU code generator is Triton,
so compiling needs a CUDA device with Triton installed; on the CPU inductor would need a C++
toolchain and minutes of compilation, so the CPU runs eagerly). `K3_TORCH_COMPILE=0` switches
compilation off (for bisecting a wrong output).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

COMPILE_ENV = "K3_TORCH_COMPILE"


@functools.cache
def grouped_gemm_supported(device: str) -> bool:
    """True when `device` runs torch._grouped_mm on bf16: the torch build has it for the device
    (on a CUDA-compatible device, compute capability 9.0 or above, where torch ships the grouped
    kernels, and without a host synchronisation: torch's fallback loop reads the group offsets
    on the host, which a captured decode graph cannot do; torch's CPU build from 2.9), checked
    once by one small product against a matmul, on CUDA under torch's sync debug mode."""
    kind = torch.device(device).type
    if not hasattr(torch, "_grouped_mm") or kind not in ("cuda", "cpu"):
        return False
    if kind == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (9, 0)):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(32, 64, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(2, 32, 64, generator=gen).to(device, torch.bfloat16).transpose(-2, -1)   # moe_w4a16's layout
    offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
    debug = torch.cuda.get_sync_debug_mode() if kind == "cuda" else None
    try:
        if kind == "cuda":
            torch.cuda.set_sync_debug_mode("error")   # a host read (torch's fallback loop) raises
        got = torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):       # no kernels, or not graph-safe: the slots / loops serve
        return False
    finally:
        if kind == "cuda":
            torch.cuda.set_sync_debug_mode(debug)
    want = torch.cat([a[:16] @ b[0], a[16:] @ b[1]])
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


@functools.cache
def compile_supported(device: str) -> bool:
    """True when torch.compile can generate fused kernels for `device`: a CUDA device with
    Triton importable, unless K3_TORCH_COMPILE=0."""
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return False
    return str(device).startswith("cuda") and torch.cuda.is_available() \
        and importlib.util.find_spec("triton") is not None


@functools.cache
def graphs_supported(device: str) -> bool:
    """True when `device` can record CUDA graphs (a CUDA-compatible torch device)."""
    return str(device).startswith("cuda") and torch.cuda.is_available()


def maybe_compile(fn, device: str):
    """`fn` compiled (dynamic shapes) where `compile_supported(device)`, else `fn` itself."""
    if not compile_supported(device):
        return fn
    compiled = torch.compile(fn, dynamic=True)
    functools.update_wrapper(compiled, fn)
    return compiled
