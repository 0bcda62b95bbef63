"""TPU platform plugin (entry point `tpu`): hook implementations only.

Backs detection, capabilities (from torch-xla, imported only when the TPU is selected),
serving defaults, conformance expectations, static-shape buckets (`shapes.py`: the engine pads
every step to them), the step end (`graphs.step_end`: `torch_xla.sync` after each forward), the
XLA graph runner (`graphs.py`: decode steps compiled once per batch bucket) and the kernel tables
of `k3.platforms.xla_kernels.tables`: every kernel entry,
each XLA-clean (no host read, static shapes, no CPU fallback).
"""

from __future__ import annotations

from pathlib import Path

from k3.platforms.xla_kernels import tables as kernels
from k3.plugin import hookimpl

from . import capabilities, detect, shapes

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
    return {"gpu_memory_utilization": 0.9}


@hookimpl
def k3_conformance_expectations():
    return str(CONFORMANCE)


@hookimpl
def k3_graph_runner():
    from .graphs import XlaGraphRunner

    return XlaGraphRunner()


@hookimpl
def k3_step_end():
    from .graphs import step_end

    return step_end


@hookimpl
def k3_shape_buckets(max_num_seqs, max_num_batched_tokens):
    return shapes.buckets(max_num_seqs, max_num_batched_tokens)


@hookimpl
def k3_kda_kernels():
    return kernels.kda_table()


@hookimpl
def k3_mla_kernels():
    return kernels.mla_table()


@hookimpl
def k3_indexer_kernels():
    return kernels.indexer_table()


@hookimpl
def k3_moe_kernels():
    return kernels.moe_table()


@hookimpl
def k3_attn_res_kernels():
    return kernels.attn_res_table()


@hookimpl
def k3_elementwise_kernels():
    return kernels.elementwise_table()


@hookimpl
def k3_quant_kernels():
    return kernels.quant_table()


@hookimpl
def k3_lora_kernels():
    return kernels.lora_table()


@hookimpl
def k3_dense_kernels():
    return kernels.dense_table()
