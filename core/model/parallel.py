"""Parallel context: which shard of the model this process holds, and its collectives.

Tensor parallelism (TP) splits attention heads (KDA and MLA), FFN widths (dense MLP, shared
experts) and the vocabulary across the ranks of one group. MLA latents, DSA index keys,
AttnRes, norms, the router and the LatentMoE projections are replicated.

The routed experts are split by expert in contiguous blocks. Without an expert-parallel (EP)
group they are split over the TP group: every TP rank sees every token and the latent partials
are all-reduced (the pre-EP behaviour). With an EP group (`ExpertParallel`) they are split over
that group instead and each token's rows travel to the ranks owning its experts by all-to-all
(`k3.model.expert_dispatch`); the EP group may span data-parallel replicas with distinct tokens.

TP = 1 on one process is the degenerate case: every shard is the whole tensor and every
collective is the identity.

Decode context parallelism (DCP, `DecodeContextParallel`) splits the MLA layers' attention
records (latent rows and DSA index keys) by token over its group: rank r of W stores the tokens
t with t % W == r. Every DCP rank runs the same tokens through the whole model (its TP shard of
it); only MLA attention reads the context across ranks: partial attention over each rank's
tokens, combined by log-sum-exp, and the DSA top-k through `k3.model.dcp_topk`. KDA states are
not sharded. docs/context-parallel.md.

Collectives go through the small `Collectives` interface so the plugin layer can put vendor
backends (NVLink mailboxes, HIP-IPC all-gather) behind it; `TorchDistributedCollectives` is the
portable default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

DISPATCH_MODES = ("all_to_all", "all_to_all_static")

# split sizes of all_to_all_single: one row count per rank, on the host or as a device tensor
Splits = Sequence[int] | torch.Tensor | None


class Collectives(Protocol):
    """What the model graph needs from a communication backend (sum reductions only)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group's ranks, same shape and dtype."""

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' x concatenated along dim, in rank order."""

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: Splits = None,
                          input_split_sizes: Splits = None) -> torch.Tensor:
        """x [N, ...] cut along dim 0 into one piece per rank, input_split_sizes[r] rows for
        rank r (None: N / world rows each); returns the pieces received, concatenated in rank
        order along dim 0: [sum(output_split_sizes), ...] (None: N / world rows from each, x's
        shape). Split sizes are host integers or an int tensor of `world` counts (a backend
        that cannot use device counts reads them on the host: one synchronisation)."""


class RowExchange(Protocol):
    """What a layer needs from a token-sharded prefill (`k3.model.token_sharded`): its call's
    tokens are this rank's pieces of one prompt, and the rows it caches per token (MLA latents,
    DSA index keys) are gathered over the ranks so every rank's cache holds the whole prompt."""

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """local [T_local, ...] rows of this rank's tokens -> [T_all, ...] every rank's, in
        token order (any dtype, float8 included)."""

    def slots(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page [T_all], offset [T_all]) of every prompt token's cache row."""


def _host_splits(splits: Splits) -> list[int] | None:
    return splits.tolist() if isinstance(splits, torch.Tensor) else None if splits is None else list(splits)


class LocalCollectives:
    """World size 1: every collective returns its input."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: Splits = None,
                          input_split_sizes: Splits = None) -> torch.Tensor:
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

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: Splits = None,
                          input_split_sizes: Splits = None) -> torch.Tensor:
        import torch.distributed as dist

        out_splits, in_splits = _host_splits(output_split_sizes), _host_splits(input_split_sizes)
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=self.group)
        return out


@dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel group of this process.

    rank, size: this process's place in the EP group; the routed experts are placed in
        contiguous blocks, rank r holding [r E / size, (r + 1) E / size).
    collectives: the EP group's collectives (dispatch uses `all_to_all_single`).
    split_tokens_over_tp: the tokens of a step are replicated over the TP ranks (attention TP
        inside the EP group): TP rank t dispatches only its slice t of them and the MoE outputs
        are all-gathered over TP, so no expert work is duplicated. False: every rank dispatches
        all its tokens (TP = 1; tokens distinct per EP rank, as under data parallelism).
    dispatch: the default dispatch of a forward (a step may override it):
        "all_to_all": the per-(peer, expert) row counts are exchanged first and read on the
            host for the payload's split sizes (one host synchronisation per MoE layer; prefill).
        "all_to_all_static": no host synchronisation (decode, graph capture): counts exchanged
            on the device, the payload in equal per-peer blocks of capacity x top_k rows, the
            receiver masking the padding rows.
    capacity: the default capacity of "all_to_all_static": an upper bound, the same on every
        EP rank, on the tokens any rank passes to one MoE call in the step (before the TP
        slice). A runtime all-reduces (max) its ranks' token counts per step and passes the
        result as the forward's `ep_capacity`; a fixed bound (e.g. the captured decode batch
        size) may stand here instead.

    Every rank of the EP group must make the same sequence of MoE calls per step (a rank
    without tokens calls `K3ForCausalLM.idle_forward`) with the same dispatch and capacity,
    or the collectives deadlock or mix up rows.
    """

    rank: int = 0
    size: int = 1
    collectives: Collectives = field(default_factory=LocalCollectives)
    split_tokens_over_tp: bool = False
    dispatch: str = "all_to_all"
    capacity: int | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} is outside expert-parallel size {self.size}")
        check_dispatch(self.dispatch, self.capacity)

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: Splits = None,
                          input_split_sizes: Splits = None) -> torch.Tensor:
        if self.size == 1:
            return x
        return self.collectives.all_to_all_single(x, output_split_sizes, input_split_sizes)


@dataclass
class DCPStats:
    """Counters of one DCP group (tests, benchmarks): rows that took the distributed top-k's
    resend path, top-k calls, the attention records (latent rows) this rank stored, rows that
    took the top-k's exact round (tied 16-bit keys at the cut, `k3.model.dcp_topk_packed`)
    and the bytes this rank sent in the top-k's all-gathers."""

    resent_rows: int = 0
    topk_calls: int = 0
    stored_rows: int = 0
    tie_rows: int = 0
    topk_wire_bytes: int = 0


@dataclass(frozen=True)
class DecodeContextParallel:
    """The decode-context-parallel group of this process (token-interleaved attention records).

    rank, size: this process's place in the DCP group; it stores the MLA latent rows and index
        keys of the tokens at positions p with p % size == rank, at its local position p // size
        (the block table and page pool address local positions).
    collectives: the DCP group's collectives (`all_gather` of the partial attention and of the
        top-k candidates).
    heads_split: the DCP group lies inside the tensor-parallel group (vLLM's layout: DCP
        divides TP), so its ranks hold different attention heads: the absorbed queries are
        all-gathered over the DCP group before attention and each rank keeps its own heads of
        the combined output. False: every DCP rank holds the same heads (TP = 1 inside it).
    stats: counters (`DCPStats`), mutable.

    Every rank of the group must run the same tokens in the same forward calls (the tokens are
    replicated over DCP, like over TP) or the collectives deadlock.
    """

    rank: int = 0
    size: int = 1
    collectives: Collectives = field(default_factory=LocalCollectives)
    heads_split: bool = False
    stats: DCPStats = field(default_factory=DCPStats, compare=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"decode-context-parallel rank {self.rank} is outside decode-context-parallel size "
                             f"{self.size}")

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        """bool, positions' shape: the tokens whose attention records this rank stores."""
        return positions % self.size == self.rank

    def local_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Tokens of each sequence stored on this rank, of seq_lens tokens in all (same shape)."""
        return ((seq_lens - self.rank + self.size - 1) // self.size).clamp_min(0)

    def stack_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x in rank order."""
        return x[None] if self.size == 1 else self.collectives.all_gather(x.unsqueeze(0), 0)


def check_dispatch(dispatch: str, capacity: int | None) -> None:
    """Raise ValueError for an unknown dispatch mode or a negative capacity."""
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"unknown MoE dispatch {dispatch!r}; known: {', '.join(DISPATCH_MODES)}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"expert-parallel capacity must be >= 0 tokens, got {capacity}")


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group (rank, world_size, collectives:
    attention heads, dense MLP and shared-expert widths, vocabulary), and optionally its
    expert-parallel group (`ep`; None: the experts split over the TP group, every TP rank
    seeing every token), and optionally its decode-context-parallel group (`dcp`; None or
    size 1: every rank stores every token's attention records). dp_rank / dp_size: the data-parallel replica this process serves
    (the runtime's bookkeeping; the graph reads only `ep`)."""

    rank: int = 0
    world_size: int = 1
    collectives: Collectives = field(default_factory=LocalCollectives)
    ep: ExpertParallel | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dcp: DecodeContextParallel | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"data-parallel rank {self.dp_rank} is outside data-parallel size {self.dp_size}")

    @classmethod
    def from_torch_distributed(cls, group=None) -> "ParallelContext":
        """The TP context of an initialised torch.distributed group (default: the world); no EP."""
        import torch.distributed as dist

        return cls(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                   collectives=TorchDistributedCollectives(group))

    @classmethod
    def from_groups(cls, tp_group=None, ep_group=None, dp_rank: int = 0, dp_size: int = 1,
                    dispatch: str = "all_to_all", *, capacity: int | None = None,
                    tp_collectives: Collectives | None = None,
                    ep_collectives: Collectives | None = None, dcp_group=None,
                    dcp_collectives: Collectives | None = None) -> "ParallelContext":
        """The context a runtime builds from initialised torch.distributed process groups.

        tp_group: this process's tensor-parallel group (None: TP = 1, this process alone; not
            the world).
        ep_group: its expert-parallel group (None: no EP, the experts split over the TP group).
            Typically the whole DP x TP world: the data-parallel replicas hold distinct tokens
            and, when TP > 1, the TP ranks of a replica split their replicated tokens between
            them (`ExpertParallel.split_tokens_over_tp`, set when the TP group has > 1 rank).
            num_experts must divide by its size.
        dp_rank, dp_size: this process's data-parallel replica (bookkeeping).
        dispatch, capacity: the defaults of `ExpertParallel.dispatch` / `.capacity`.
        dcp_group: its decode-context-parallel group (None: DCP = 1), a subset of the TP group
            (`DecodeContextParallel.heads_split` when TP > 1) or, with TP = 1, any group of
            ranks running the same tokens.
        tp_collectives, ep_collectives, dcp_collectives: the groups' collectives, e.g. the platform's
            `Platform.collectives(group)` (vendor backends first); default
            `TorchDistributedCollectives(group)`.

        Example, DP = 2 x TP = 2 on 4 ranks with EP over all of them:
            tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
            ParallelContext.from_groups(tp_group=tp, ep_group=dist.group.WORLD,
                                        dp_rank=rank // 2, dp_size=2)
        """
        import torch.distributed as dist

        tp_rank, tp_size = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
        tp_coll = tp_collectives or (LocalCollectives() if tp_group is None else TorchDistributedCollectives(tp_group))
        ep = None
        if ep_group is not None:
            ep = ExpertParallel(rank=dist.get_rank(ep_group), size=dist.get_world_size(ep_group),
                                collectives=ep_collectives or TorchDistributedCollectives(ep_group),
                                split_tokens_over_tp=tp_size > 1, dispatch=dispatch, capacity=capacity)
        dcp = None
        if dcp_group is not None:
            dcp = DecodeContextParallel(rank=dist.get_rank(dcp_group), size=dist.get_world_size(dcp_group),
                                        collectives=dcp_collectives or TorchDistributedCollectives(dcp_group),
                                        heads_split=tp_size > 1)
        return cls(rank=tp_rank, world_size=tp_size, collectives=tp_coll, ep=ep, dp_rank=dp_rank, dp_size=dp_size,
                   dcp=dcp)

    @property
    def context_parallel(self) -> DecodeContextParallel | None:
        """The DCP group when it has more than one rank (None: attention records unsharded)."""
        return self.dcp if self.dcp is not None and self.dcp.size > 1 else None

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` items; `what` names them in errors."""
        if total % self.world_size:
            raise ValueError(f"{what} = {total} does not split evenly over tensor-parallel size {self.world_size}")
        size = total // self.world_size
        return self.rank * size, size

    def expert_shard(self, num_experts: int) -> tuple[int, int]:
        """(start, count) of the routed experts this rank holds: a contiguous block of the EP
        group's split, or of the TP group's without EP."""
        if self.ep is None:
            return self.shard(num_experts, "num_experts")
        if num_experts % self.ep.size:
            raise ValueError(f"num_experts = {num_experts} does not split evenly over expert-parallel size "
                             f"{self.ep.size}")
        count = num_experts // self.ep.size
        return self.ep.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.world_size == 1 else self.collectives.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if self.world_size == 1 else self.collectives.all_gather(x, dim)
