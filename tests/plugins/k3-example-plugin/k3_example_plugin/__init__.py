"""k3-example-plugin: a third-party platform that overrides one kernel entry and chooses its
cache memory and KDA state-row layout.

The module is the plugin (entry point `example` in the `k3` group). It declares the hookspec
versions it supports and implements six hooks; every other hook and kernel entry falls back
to the reference plugin.
"""

from __future__ import annotations

import functools
import platform as _host

import torch

from k3 import hookimpl
from k3 import reference as ref
from k3.plugin import Capabilities, Detection, ElementwiseKernels

K3_HOOKSPEC_VERSIONS = (1,)
NAME = "example"

calls = {"rms_norm": 0, "allocate_cache": 0}    # how often each override ran (tests read it)
CACHE_ALIGNMENT = 4096                           # the example device wants page-aligned rows


@functools.wraps(ref.rms_norm)
def rms_norm(*args, **kwargs):
    """The reference rms_norm, counted: same signature, same result."""
    calls["rms_norm"] += 1
    return ref.rms_norm(*args, **kwargs)


@hookimpl
def k3_detect_platform():
    return Detection(NAME, available=False, forceable=True, device="cpu",
                     reason="the example platform is never detected: select it with --platform example "
                            "or K3_PLATFORM=example")


@hookimpl
def k3_capabilities(platform):
    if platform.name != NAME:
        return None
    return Capabilities(vendor="example", arch=_host.machine(), device_name="CPU (k3-example-plugin)",
                        device_count=1, dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}),
                        fp8_dtype="e4m3fn", cache_alignment_bytes=CACHE_ALIGNMENT)


@hookimpl
def k3_elementwise_kernels(platform):
    # Only on its own platform: in a shared environment it never changes another platform's kernels.
    return ElementwiseKernels(rms_norm=rms_norm) if platform.name == NAME else None


@hookimpl
def k3_config_defaults(platform):
    return {"max_num_seqs": 4} if platform.name == NAME else None


@hookimpl
def k3_allocate_cache(platform, num_rows, row_bytes, alignment):
    """An over-allocated buffer, sliced so the first row starts `alignment`-aligned."""
    if platform.name != NAME:
        return None
    calls["allocate_cache"] += 1
    raw = torch.full((num_rows * row_bytes + alignment,), 0xFF, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    return raw[start: start + num_rows * row_bytes].view(num_rows, row_bytes)


@hookimpl
def k3_kda_state_layout(platform):
    # each head's state stored transposed: the core must work unchanged through the views
    return "hvk" if platform.name == NAME else None
