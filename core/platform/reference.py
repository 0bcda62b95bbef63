"""The reference plugin: pure torch on any device, always registered, `trylast`.

It is the reference platform's plugin (detection, capabilities) and the fallback of every
other hook on every platform: its kernel tables are the pure-torch kernel set
(`k3.platforms.torch_kernels.tables`: torch fast paths, else the `k3.reference` ops), so every
kernel table resolves and a vendor plugin replaces only the entries it really implements. Its
capabilities are asked only when the reference platform is the selected one (the facade asks
a platform's own plugin for them).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from k3.plugin.markers import HOOKSPEC_VERSION, hookimpl
from k3.plugin.markers import batch_invariant as mark_invariant
from k3.plugin.types import Capabilities, Detection
from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.platforms.torch_kernels.tables import torch_tables

from .collectives import TorchDistributedBackend

K3_HOOKSPEC_VERSIONS = (HOOKSPEC_VERSION,)
NAME = "reference"


@hookimpl(trylast=True)
def k3_detect_platform():
    return Detection(name=NAME, available=True, reason="pure torch on the CPU (always available)",
                     forceable=True, priority=-100, device="cpu")


@hookimpl(trylast=True)
def k3_capabilities():
    return Capabilities(vendor="cpu", arch=os.uname().machine, device_name="CPU (reference ops)",
                        device_count=1, dist_backend="gloo",
                        dtypes=frozenset({"bfloat16", "float16", "float32", "float64"}), fp8_dtype="e4m3fn")


def _table(family: str):
    @hookimpl(trylast=True)
    def hook(platform, batch_invariant):
        # In the batch-invariant mode on the CPU: the invariant kernel set (fixed-tree sums,
        # fixed-shape GEMM row blocks, scalar-path transcendental functions: their construction
        # is k3.platforms.torch_kernels.invariant's docstring), marked. Elsewhere nothing is
        # marked: a vendor plugin that trusts its device's GEMMs marks these kernels itself.
        if not batch_invariant or torch.device(platform.device).type != "cpu":
            return torch_tables()[family]
        table = invariant_tables()[family]
        return dataclasses.replace(table, **{e: mark_invariant(getattr(table, e)) for e in table.provided()})

    return hook


k3_kda_kernels = _table("kda")
k3_mla_kernels = _table("mla")
k3_indexer_kernels = _table("indexer")
k3_moe_kernels = _table("moe")
k3_attn_res_kernels = _table("attn_res")
k3_elementwise_kernels = _table("elementwise")
k3_quant_kernels = _table("quant")
k3_lora_kernels = _table("lora")
k3_dense_kernels = _table("dense")


@hookimpl(trylast=True)
def k3_collective_backends(group):
    return [TorchDistributedBackend(group)]


@hookimpl(trylast=True)
def k3_allocate_cache(platform, num_rows, row_bytes, alignment):
    # allocators align to 64 (CPU) or 512 bytes (CUDA): over-allocate and start at an aligned byte
    raw = torch.full((num_rows * row_bytes + alignment,), 0xFF, dtype=torch.uint8, device=platform.device)
    start = (-raw.data_ptr()) % alignment
    return raw[start: start + num_rows * row_bytes].view(num_rows, row_bytes)


@hookimpl(trylast=True)
def k3_kda_state_layout():
    return "hkv"


@hookimpl(trylast=True)
def k3_graph_runner():
    return None                 # decode runs eagerly


@hookimpl(trylast=True)
def k3_step_end():
    return None                 # eager: nothing to cut


@hookimpl(trylast=True)
def k3_shape_buckets():
    return None                 # every step runs at its own shape


@hookimpl(trylast=True)
def k3_process_weights():
    return None


@hookimpl(trylast=True)
def k3_config_defaults():
    return {}


@hookimpl(trylast=True)
def k3_validate_config():
    return []


@hookimpl(trylast=True)
def k3_add_cli_options():
    return None


@hookimpl(trylast=True)
def k3_conformance_expectations():
    return None
