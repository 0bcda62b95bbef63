"""Parallel context: which shard of the model this process holds, and its collectives.

Tensor parallelism splits attention heads (KDA and MLA), FFN widths and the vocabulary across
the ranks of one group; the routed experts are split across the same group (expert parallel).
MLA latents, DSA index keys, AttnRes, norms, the router and the LatentMoE projections are
replicated. TP = 1 on one process is the degenerate case: every shard is the whole tensor and
every collective is the identity.

Collectives go through the small `Collectives` interface so the plugin layer can put vendor
backends (NVLink mailboxes, HIP-IPC all-gather) behind it; `TorchDistributedCollectives` is the
portable default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Collectives(Protocol):
    """What the model graph needs from a communication backend (sum reductions only)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group's ranks, same shape and dtype."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' x concatenated along dim, in rank order."""


class LocalCollectives:
    """World size 1: every collective returns its input."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


class TorchDistributedCollectives:
    """torch.distributed collectives on one process group (gloo on the CPU, NCCL on GPUs)."""

    def __init__(self, group=None):
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor/expert-parallel group."""

    rank: int = 0
    world_size: int = 1
    collectives: Collectives = field(default_factory=LocalCollectives)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")

    @classmethod
    def from_torch_distributed(cls, group=None) -> "ParallelContext":
        """The context of an initialised torch.distributed group (default: the world)."""
        import torch.distributed as dist

        return cls(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                   collectives=TorchDistributedCollectives(group))

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` items; `what` names them in errors."""
        if total % self.world_size:
            raise ValueError(f"{what} = {total} does not split evenly over tensor-parallel size {self.world_size}")
        size = total // self.world_size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.world_size == 1 else self.collectives.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.world_size == 1 else self.collectives.all_gather(x, dim)
