"""NVIDIA platform plugin (entry point `nvidia`): hook implementations only.

Backs detection, capabilities, serving defaults, conformance expectations, CUDA-graph capture,
the symmetric-memory all-reduce (symm_mem.py, opt-in) and the kernels listed in experimental.py (k3.platforms.triton_kernels, torch_kernels), each when
the modules it needs are installed: the promoted set by default (K3_NVIDIA_DISABLE takes one
out), the experimental ones when K3_NVIDIA_EXPERIMENTAL names them. Every other kernel entry
falls back to the reference plugin's pure-torch kernels on device "cuda" (where
`moe_experts_bf16` serves, `k3_process_weights` repacks the MoE experts tile-major). In the batch-invariant
mode every kernel hook serves a full table marked batch invariant (invariant.py: its invariant
Triton kernels and the torch invariant set). A platform plugin's hooks are asked only while its
platform is selected, so none checks the platform name.
"""

from __future__ import annotations

from pathlib import Path

from k3.plugin import (AttnResKernels, DenseKernels, ElementwiseKernels, IndexerKernels, KDAKernels, LoRAKernels,
                       MLAKernels, MoEKernels, QuantKernels, hookimpl)

from . import capabilities, detect, experimental

K3_HOOKSPEC_VERSIONS = (1,)
NAME = detect.NAME
CONFORMANCE = Path(__file__).with_name("conformance.toml")


@hookimpl
def k3_detect_platform():
    return detect.detect()


@hookimpl
def k3_capabilities():
    return capabilities.read()


@hookimpl
def k3_config_defaults():
    # vLLM's default memory fraction, which the NVIDIA quick start keeps.
    return {"gpu_memory_utilization": 0.9}


@hookimpl
def k3_graph_runner():
    from .graphs import CudaGraphCapturer

    return CudaGraphCapturer()


@hookimpl
def k3_collective_backends(platform, group):
    from .symm_mem import backends_for

    return backends_for(group, capabilities.read())


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)


@hookimpl
def k3_process_weights(model):
    """Where `moe_experts_bf16` serves the MoE experts (promoted; not when K3_NVIDIA_DISABLE names it or
    an experimental moe.experts kernel is named instead), every MXFP4 routed-expert stack is repacked
    tile by tile in place (`k3.model.ffn.MoE.hold_experts_tile_major`: 4 KB contiguous code blocks a
    tile step, which every MoE mode of that kernel reads)."""
    if experimental.serving("moe.experts") == "moe_experts_bf16":
        for module in model.modules():
            if hasattr(module, "hold_experts_tile_major"):
                module.hold_experts_tile_major()


def _kernel_table(family: str, table):
    """The `table` (a KernelTable class) of `family` holding, for each of its entries in
    experimental.py, the kernel that serves it (`experimental.serving`); None when none does (the
    reference plugin serves every entry)."""
    entries = {}
    for family_entry in dict.fromkeys(kernel.entry for kernel in experimental.ALL.values()):
        kernel_family, entry = family_entry.split(".")
        name = experimental.serving(family_entry) if kernel_family == family else None
        if name is not None:
            entries[entry] = experimental.ALL[name].function()
    return table(**entries) if entries else None


def _tables(family: str, table, batch_invariant: bool):
    """The family's table: in the batch-invariant mode every entry, marked (invariant.py), else
    `_kernel_table`'s."""
    if batch_invariant:
        from . import invariant

        return invariant.table(family)
    return _kernel_table(family, table)


def _hook(family: str, table):
    @hookimpl
    def hook(batch_invariant):
        return _tables(family, table, batch_invariant)

    return hook


k3_kda_kernels = _hook("kda", KDAKernels)
k3_moe_kernels = _hook("moe", MoEKernels)
k3_mla_kernels = _hook("mla", MLAKernels)
k3_indexer_kernels = _hook("indexer", IndexerKernels)
k3_attn_res_kernels = _hook("attn_res", AttnResKernels)
k3_elementwise_kernels = _hook("elementwise", ElementwiseKernels)
k3_lora_kernels = _hook("lora", LoRAKernels)
k3_quant_kernels = _hook("quant", QuantKernels)
k3_dense_kernels = _hook("dense", DenseKernels)
