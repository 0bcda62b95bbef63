"""SPMD sharding of a K3 model over a TPU device mesh (torch_xla.distributed.spmd).

One process drives every chip: the weights carry sharding annotations (`mark_sharding`) and
XLA's GSPMD partitioner splits the graph and inserts the collectives. The mesh has one axis,
"model", shared by tensor parallelism and expert parallelism (the seed's TP32 / EP32 layout on
TPU v7x: the same chips split the heads and the experts):

- TP, column-parallel (output rows split): the KDA input projection and its gate projection,
  MLA's q_b / kv_b projections (so attention heads), the dense MLP's and shared experts'
  gate_up projections;
- TP, row-parallel (input columns split): the attention output projections and the down
  projections (XLA adds the all-reduce);
- EP: every stacked routed-expert tensor `[E, ...]` (`w13*`, `w2*`: packed MXFP4 planes, their
  scales, dequantised copies) split on the expert axis;
- everything else (embeddings, norms, routers, the LM head, the latent projections of the
  routed experts, the cache) replicated.

GSPMD keeps the partitioned program equal to the unpartitioned one; tests/tpu/test_spmd.py runs
it on PJRT CPU with 4 virtual devices and checks the logits against the single-device forward
and the shardings in the lowered HLO. Not wired into the engine yet (`k3 serve` on a TPU host
runs one chip).
"""

from __future__ import annotations

import re

AXIS = "model"
COLUMN = re.compile(r"self_attn\.(in_proj|f_b_proj|q_b_proj|kv_b_proj)$|(mlp|shared_experts)\.gate_up_proj$")
ROW = re.compile(r"self_attn\.o_proj$|(mlp|shared_experts)\.down_proj$")
EXPERTS = re.compile(r"block_sparse_moe\.(w13|w2)\w*$")


def mesh(num_devices: int | None = None):
    """A one-axis ("model") mesh over the runtime's devices (SPMD mode must be on: `xr.use_spmd()`)."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = num_devices or xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), (AXIS,))


def spec(name: str, ndim: int) -> tuple | None:
    """The partition spec of tensor `name` (None: replicated)."""
    if EXPERTS.search(name):
        return (AXIS,) + (None,) * (ndim - 1)
    if ndim == 2 and COLUMN.search(name):
        return (AXIS, None)
    if ndim == 2 and ROW.search(name):
        return (None, AXIS)
    return None


def shard_model(model, device_mesh) -> dict[str, tuple]:
    """Annotate every parameter and buffer of `model` (on the XLA device) with its sharding over
    `device_mesh`; returns {name: partition spec} of the sharded ones."""
    import torch_xla.distributed.spmd as xs

    sharded = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        partition = spec(name, tensor.dim())
        if partition is not None and tensor.shape[partition.index(AXIS)] % device_mesh.size() == 0:
            xs.mark_sharding(tensor, device_mesh, partition)
            sharded[name] = partition
    return sharded
