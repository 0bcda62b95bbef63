"""A distributed serving topology, as vLLM spells it: TP x DP GPUs over nnodes x gpus_per_node.

- world = tensor_parallel_size x data_parallel_size GPUs, and nnodes x gpus_per_node must
  equal it (gpus_per_node defaults to min(world, 8), nnodes to world / gpus_per_node);
- attention (KDA, MLA, the DSA indexer), the dense layers, the shared experts, the embedding
  and lm_head are sharded over TP and replicated over DP;
- routed experts: without expert parallelism they are split over TP (each TP rank holds
  num_experts / TP of them) and replicated over DP; with `--enable-expert-parallel` the
  expert-parallel size is TP x DP and each rank holds num_experts / EP (contiguous blocks, as
  the loader reads them); an explicit `--expert-parallel-size EP` must divide TP x DP and be a
  multiple of TP, and the experts are then replicated over the TP x DP / EP expert groups;
- each DP rank is an engine with its own cache.

`Topology.build` checks the sizes and says which flag is wrong; the model-dependent check
(num_experts divisible by the expert split) is `experts_per_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_GPU_MEMORY_GIB = 80.0      # memory per accelerator when none is known (`k3 plan --gpu-memory`)


@dataclass(frozen=True)
class Topology:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int | None = None     # None: expert parallelism off (experts split over TP)
    nnodes: int = 1
    gpus_per_node: int = 1

    @classmethod
    def build(cls, tensor_parallel_size: int = 1, data_parallel_size: int = 1, *,
              enable_expert_parallel: bool = False, expert_parallel_size: int | None = None,
              nnodes: int | None = None, gpus_per_node: int | None = None) -> "Topology":
        """Check and complete a topology; ValueError names the flag that is wrong.

        An explicit expert_parallel_size turns expert parallelism on; enable_expert_parallel
        alone gives EP = TP x DP."""
        tp, dp = tensor_parallel_size, data_parallel_size
        for flag, value in (("--tensor-parallel-size", tp), ("--data-parallel-size", dp),
                            ("--expert-parallel-size", expert_parallel_size), ("--nnodes", nnodes),
                            ("--gpus-per-node", gpus_per_node)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        world = tp * dp
        ep = expert_parallel_size if expert_parallel_size is not None else (world if enable_expert_parallel else None)
        if ep is not None and (world % ep or ep % tp):
            raise ValueError(f"--expert-parallel-size {ep} must divide --tensor-parallel-size {tp} x "
                             f"--data-parallel-size {dp} = {world} GPUs and be a multiple of TP (each expert "
                             "group is whole DP ranks, as `k3 serve` places them)")
        if gpus_per_node is None:
            if nnodes is not None:
                if world % nnodes:
                    raise ValueError(f"--nnodes {nnodes} does not divide the {world} GPUs of --tensor-parallel-size "
                                     f"{tp} x --data-parallel-size {dp}")
                gpus_per_node = world // nnodes
            else:
                gpus_per_node = min(world, DEFAULT_GPUS_PER_NODE)
        if nnodes is None:
            if world % gpus_per_node:
                raise ValueError(f"--gpus-per-node {gpus_per_node} does not divide the {world} GPUs of "
                                 f"--tensor-parallel-size {tp} x --data-parallel-size {dp}: pass --nnodes too, "
                                 "or change the sizes")
            nnodes = world // gpus_per_node
        if nnodes * gpus_per_node != world:
            raise ValueError(f"--nnodes {nnodes} x --gpus-per-node {gpus_per_node} = {nnodes * gpus_per_node} GPUs, "
                             f"but --tensor-parallel-size {tp} x --data-parallel-size {dp} = {world} GPUs")
        return cls(tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=ep, nnodes=nnodes,
                   gpus_per_node=gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_split(self) -> int:
        """How many ways the routed experts are split: EP when on, else TP."""
        return self.expert_parallel_size or self.tensor_parallel_size

    def experts_per_rank(self, num_experts: int | None) -> int:
        """Routed experts one GPU holds (0 for a dense model); ValueError when they do not split."""
        if not num_experts:
            return 0
        if num_experts % self.expert_split:
            what = (f"expert-parallel size {self.expert_parallel_size}" if self.expert_parallel_size
                    else f"tensor-parallel size {self.tensor_parallel_size}")
            raise ValueError(f"num_experts = {num_experts} does not split evenly over {what}")
        return num_experts // self.expert_split

    def flags(self, *, nodes: bool = True) -> list[str]:
        """The command-line flags of this topology (`k3 plan`, later `k3 serve`)."""
        out = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.data_parallel_size > 1:
            out += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.expert_parallel_size is not None:
            out.append("--enable-expert-parallel")
            if self.expert_parallel_size != self.world_size:
                out += ["--expert-parallel-size", str(self.expert_parallel_size)]
        if nodes and (self.nnodes > 1 or self.gpus_per_node != min(self.world_size, DEFAULT_GPUS_PER_NODE)):
            out += ["--nnodes", str(self.nnodes), "--gpus-per-node", str(self.gpus_per_node)]
        return out

    def describe(self) -> str:
        """'32 GPUs, 4 nodes of 8' / '8 GPUs, 1 node'."""
        gpus = f"{self.world_size} GPU{'s' if self.world_size > 1 else ''}"
        if self.nnodes == 1:
            return f"{gpus}, 1 node"
        return f"{gpus}, {self.nnodes} nodes of {self.gpus_per_node}"

    def to_dict(self) -> dict:
        return {"tensor_parallel_size": self.tensor_parallel_size, "data_parallel_size": self.data_parallel_size,
                "enable_expert_parallel": self.expert_parallel_size is not None,
                "expert_parallel_size": self.expert_parallel_size, "nnodes": self.nnodes,
                "gpus_per_node": self.gpus_per_node, "world_size": self.world_size, "flags": self.flags()}


def candidate_topologies(*, gpus_per_node: int = DEFAULT_GPUS_PER_NODE, max_gpus: int = 1024,
                         tensor_parallel_sizes: tuple[int, ...] = (1, 2, 4, 8)):
    """Topologies in the planner's order of preference: fewest GPUs, then more expert
    parallelism (EP = TP x DP before EP off), then fewer TP. TP stays within a node
    (TP <= gpus_per_node); a world larger than a node fills whole nodes."""
    for world in range(1, max_gpus + 1):
        node = min(world, gpus_per_node)
        if world % node:
            continue
        for ep_on in ((True, False) if world > 1 else (False,)):
            for tp in tensor_parallel_sizes:
                if world % tp or tp > node:
                    continue
                yield Topology.build(tp, world // tp, enable_expert_parallel=ep_on, gpus_per_node=node)
