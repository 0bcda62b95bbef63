"""The process groups of one deployment.

Every rank calls `init_groups` after its process group is up (the same `new_group` calls in the
same order on every rank, as torch.distributed requires):

- world: the default group on the platform's backend (NCCL on GPUs, gloo on the CPU);
- tp: the contiguous ranks of this rank's DP rank, on the device backend; its TP rank 0 (the
  TP leader) runs the DP rank's LLMEngine and broadcasts each step to the others;
- dp_leaders: the TP leaders of every DP rank (global ranks 0, TP, 2 TP, ...), on gloo: the DP
  front-end's per-step exchange of requests, outputs and load;
- control: every rank, on gloo (heartbeats and start-up checks even when the device is NCCL);
- ep: this rank's expert-parallel group, when expert parallelism is on: contiguous blocks of
  `ep_size` ranks (whole DP ranks, since EP is a multiple of TP), on the device backend; the
  experts are split within a group and replicated across groups;
- dcp: this rank's decode-context-parallel group, when DCP > 1: contiguous blocks of
  `decode_context_parallel_size` ranks inside each TP group, on the device backend.

Every group has the deployment's timeout, so a peer that died is an error, not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .config import DistributedConfig


@dataclass
class Groups:
    """This rank's place and groups (see the module docstring)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    tp: object
    dp_leaders: object | None        # None on TP followers (not members)
    control: object
    ep: object | None
    tp_leader: int                   # global rank of this DP rank's TP leader
    dcp: object | None = None        # None: DCP = 1

    @property
    def is_tp_leader(self) -> bool:
        return self.tp_rank == 0


def init_world(cfg: DistributedConfig, rank: int, backend: str) -> None:
    """Join the default group through the env:// rendezvous (MASTER_ADDR / MASTER_PORT set)."""
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=cfg.timeout_s))


def init_groups(cfg: DistributedConfig, rank: int, backend: str) -> Groups:
    """The groups of `rank` (the default group must be initialised)."""
    timeout = timedelta(seconds=cfg.timeout_s)
    tp_size, dp_size = cfg.tensor_parallel_size, cfg.data_parallel_size
    dp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for d in range(dp_size):         # every rank creates every group, in the same order
        ranks = list(range(d * tp_size, (d + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if d == dp_rank:
            tp_group = group
    leaders = dist.new_group([d * tp_size for d in range(dp_size)], timeout=timeout, backend="gloo")
    control = dist.new_group(list(range(cfg.world_size)), timeout=timeout, backend="gloo")
    ep = None
    if cfg.ep_size:
        for start in range(0, cfg.world_size, cfg.ep_size):      # contiguous blocks of whole DP ranks
            group = dist.new_group(list(range(start, start + cfg.ep_size)), timeout=timeout, backend=backend)
            if start <= rank < start + cfg.ep_size:
                ep = group
    dcp, dcp_size = None, cfg.decode_context_parallel_size
    if dcp_size > 1:
        for start in range(0, cfg.world_size, dcp_size):         # contiguous blocks inside the TP groups
            group = dist.new_group(list(range(start, start + dcp_size)), timeout=timeout, backend=backend)
            if start <= rank < start + dcp_size:
                dcp = group
    return Groups(rank=rank, world_size=cfg.world_size, dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank,
                  tp_size=tp_size, tp=tp_group, dp_leaders=leaders if tp_rank == 0 else None, control=control,
                  ep=ep, tp_leader=dp_rank * tp_size, dcp=dcp)


def build_parallel_context(platform, groups: Groups, cfg: DistributedConfig):
    """The model's ParallelContext for this rank: the one place expert and decode context
    parallelism are wired.

    EP and DCP off: TP over this DP rank's TP group (each DP rank holds every expert).
    Otherwise the model's `ParallelContext.from_groups` over the TP, EP and DCP groups."""
    if not cfg.enable_expert_parallel and groups.dcp is None:
        return platform.parallel_context(groups.tp)
    from k3.model.parallel import ParallelContext

    tp = groups.tp if groups.tp_size > 1 else None
    return ParallelContext.from_groups(tp_group=tp, ep_group=groups.ep, dp_rank=groups.dp_rank,
                                       dp_size=groups.dp_size, dispatch="all_to_all",
                                       tp_collectives=platform.collectives(tp) if tp is not None else None,
                                       ep_collectives=platform.collectives(groups.ep) if groups.ep is not None else None,
                                       dcp_group=groups.dcp,
                                       dcp_collectives=platform.collectives(groups.dcp) if groups.dcp is not None else None)


def idle_forward(model, cfg: DistributedConfig) -> None:
    """What a rank with no tokens does in a step in which another DP rank runs a forward: with
    EP, join the MoE collectives with an empty batch (`K3ForCausalLM.idle_forward`); without,
    nothing (DP ranks are independent replicas)."""
    if cfg.enable_expert_parallel:
        model.idle_forward()
