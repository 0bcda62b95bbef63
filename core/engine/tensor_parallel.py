"""Tensor parallelism for the offline API: `start_tensor_parallel(config)` launches ranks
1..N-1 and returns rank 0's engine. The runtime itself is `k3.engine.distributed` (torch's
elastic launcher, env:// rendezvous, TP / DP / EP groups; docs/distributed.md)."""

from __future__ import annotations

from .config import EngineConfig
from .distributed import DistributedConfig


def distributed_config(config: EngineConfig, **launch) -> DistributedConfig:
    """The DistributedConfig of an EngineConfig (launch: nnodes, node_rank, master_addr, master_port)."""
    return DistributedConfig(tensor_parallel_size=config.tensor_parallel_size,
                             data_parallel_size=config.data_parallel_size,
                             enable_expert_parallel=config.enable_expert_parallel,
                             expert_parallel_size=config.expert_parallel_size,
                             decode_context_parallel_size=config.decode_context_parallel_size,
                             timeout_s=config.distributed_timeout, **launch)


def start_tensor_parallel(config: EngineConfig, **launch):
    """Launch the other ranks, join as rank 0 and return its engine (a DistributedEngine)."""
    from .distributed.launch import start_rank0

    return start_rank0(config, distributed_config(config, **launch))
