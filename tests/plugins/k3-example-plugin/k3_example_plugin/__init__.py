"""k3-example-plugin: a third-party platform that overrides one kernel entry and chooses its
cache memory and KDA state-row layout.

The module is the plugin (entry point `example` in the `k3` group). It declares the hookspec
versions it supports and implements six hooks; every other hook and kernel entry falls back
to the reference plugin. Its hooks answer only while the platform "example" is the selected one
(k3 blocks the platform plugins that lost the selection), so none checks the platform's name,
and each declares only the hook arguments it uses (pluggy passes just those).
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
def k3_capabilities():
    return Capabilities(vendor="example", arch=_host.machine(), device_name="CPU (k3-example-plugin)",
                        device_count=1, dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}),
                        fp8_dtype="e4m3fn", cache_alignment_bytes=CACHE_ALIGNMENT)


@hookimpl
def k3_elementwise_kernels():
    return ElementwiseKernels(rms_norm=rms_norm)


@hookimpl
def k3_config_defaults():
    return {"max_num_seqs": 4}


@hookimpl
def k3_allocate_cache(num_rows, row_bytes, alignment):
    """An over-allocated buffer, sliced so the first row starts `alignment`-aligned."""
    calls["allocate_cache"] += 1
    raw = torch.full((num_rows * row_bytes + alignment,), 0xFF, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    return raw[start: start + num_rows * row_bytes].view(num_rows, row_bytes)


@hookimpl
def k3_kda_state_layout():
    # each head's state stored transposed: the core must work unchanged through the views
    return "hvk"
