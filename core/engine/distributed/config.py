"""DistributedConfig: how many ranks, where they run and how they talk (docs/distributed.md).

World = data_parallel_size x tensor_parallel_size ranks, spread evenly over `nnodes` nodes.
Global rank r is DP rank r // TP and TP rank r % TP: each DP rank's TP group is contiguous,
so a TP group never spans nodes when TP divides the ranks per node.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """A rank failed, timed out or the layout is inconsistent; the message names the rank."""


@dataclass(frozen=True)
class DistributedConfig:
    """The layout of one deployment.

    tensor_parallel_size, data_parallel_size: TP ranks per DP rank, DP ranks;
    enable_expert_parallel / expert_parallel_size: the routed experts split over EP groups of
    expert_parallel_size contiguous ranks (default: one group of all ranks; a size implies
    enable_expert_parallel, is a multiple of TP and divides the world, and the experts are then
    replicated over the world / EP groups); decode_context_parallel_size: DCP groups of that
    many contiguous ranks inside each TP group (it divides TP; docs/context-parallel.md); nnodes, node_rank: the nodes and this one;
    master_addr, master_port: the env:// rendezvous (rank 0's TCP store; port None: a free one,
    single node only); timeout_s: every collective's timeout (a dead peer is an error after at
    most this long); heartbeat_s: rank 0's exchange interval while idle (default timeout / 10,
    at most 5 s).
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    decode_context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    timeout_s: float = 600.0
    heartbeat_s: float | None = None

    def __post_init__(self):
        if self.expert_parallel_size is not None:      # an explicit size turns EP on (as `k3 plan`)
            object.__setattr__(self, "enable_expert_parallel", True)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ep_size(self) -> int | None:
        """Ranks per expert-parallel group; None without expert parallelism."""
        if not self.enable_expert_parallel:
            return None
        return self.expert_parallel_size or self.world_size

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else min(5.0, self.timeout_s / 10)

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks of one node (default: this one)."""
        node = self.node_rank if node is None else node
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)

    def validate(self, num_experts: int | None = None) -> None:
        """Refuse layouts no rank can run (before anything is started)."""
        for name in ("tensor_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.world_size % self.nnodes:
            raise ValueError(f"data_parallel_size x tensor_parallel_size = {self.world_size} ranks do not split "
                             f"evenly over {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside [0, {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need --master-addr and --master-port (node 0's address and a free port)")
        if self.timeout_s <= 0:
            raise ValueError(f"the distributed timeout must be positive, got {self.timeout_s}")
        if self.heartbeat_interval >= self.timeout_s:
            raise ValueError(f"the heartbeat interval ({self.heartbeat_interval} s) must be below the timeout "
                             f"({self.timeout_s} s)")
        dcp = self.decode_context_parallel_size
        if dcp < 1 or self.tensor_parallel_size % dcp:
            raise ValueError(f"decode_context_parallel_size {dcp} must divide tensor_parallel_size "
                             f"{self.tensor_parallel_size} (the DCP ranks lie inside a TP group)")
        if self.enable_expert_parallel:
            ep, tp = self.ep_size, self.tensor_parallel_size
            if ep < 1 or self.world_size % ep or ep % tp:
                raise ValueError(f"expert_parallel_size {ep} must be a multiple of tensor_parallel_size {tp} and "
                                 f"divide the world (data_parallel_size x tensor_parallel_size = {self.world_size})")
            if num_experts is None:
                raise ValueError("enable_expert_parallel needs a model with routed experts")
            if num_experts % ep:
                raise ValueError(f"expert_parallel_size {ep} does not divide num_experts = {num_experts}")

    def to_json_dict(self) -> dict:
        return asdict(self)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or another launcher that
    sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), else None."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
