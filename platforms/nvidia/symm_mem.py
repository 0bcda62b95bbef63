"""The "NVLink mailbox" collectives: a one-shot all-reduce and an all-gather through torch
symmetric memory.

Every rank of a group owns one symmetric buffer per collective
(`torch.distributed._symmetric_memory.empty`, mapped into every peer's address space by
`rendezvous`). A decode-sized collective copies its input into the rank's buffer, then:
- all-reduce: `torch.ops.symm_mem.one_shot_all_reduce`: each rank reads every peer's buffer
  over NVLink and sums locally, one kernel and no NCCL ring;
- all-gather: a barrier (every input is in its buffer), one concatenation that reads every
  peer's buffer in rank order (`get_buffer` views of peer memory: NVLink loads), a barrier
  (every rank has read, so the buffers may be written again).
That is what makes small decode collectives (a few KiB to a few MiB) faster than NCCL's.

Each backend is a `k3.plugin.types.CollectiveBackend` that accepts only its op on CUDA tensors
it can hold (its dtypes, at most `max_bytes` per rank) and declines the rest, which fall
through to torch.distributed (NCCL). Set up only when the platform reports
`symmetric_memory`, the group has more than one rank on NCCL, and every rank's set-up of that
backend succeeded (agreed by an all-reduce, so no rank uses it alone); a rank whose set-up
failed logs why. Not measured on several GPUs yet (BENCHMARKS.md): opt-in until then
(`K3_NVIDIA_SYMM_MEM=1`; 0 or unset: NCCL serves every collective).
"""

from __future__ import annotations

import math
import os
import sys

import torch

ENV = "K3_NVIDIA_SYMM_MEM"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# an all-gather copies bytes: also the integer words the DCP top-k and the index keys gather
GATHER_DTYPES = DTYPES + (torch.int32, torch.int64, torch.uint8)
# per-world-size buffer sizes where one-shot beats NCCL on NVLink (the ranges others report);
# larger collectives (prefill) go to NCCL
MAX_BYTES = {2: 8 << 20, 4: 8 << 20, 8: 4 << 20}


def enabled_by_env() -> bool:
    """Opt-in for now: K3_NVIDIA_SYMM_MEM=1 (0 or unset: off)."""
    return os.environ.get(ENV, "0") == "1"


def agree(ok: bool, group, device) -> bool:
    """True only when `ok` on every rank of `group` (a MIN all-reduce: no rank uses a backend
    alone)."""
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class _SymmetricBuffer:
    """One symmetric buffer of `max_bytes` per rank of `group`, set up on every rank or none.

    group: an initialised NCCL process group (None: the default group); device: this rank's
    CUDA device; max_bytes: the buffer size (default MAX_BYTES by world size)."""

    name = "nvidia.symm_mem"
    op = ""

    def __init__(self, group=None, device=None, max_bytes: int | None = None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = max_bytes or MAX_BYTES.get(self.world_size, 4 << 20)
        self.group_name = self.group.group_name
        self.buffer: torch.Tensor | None = None
        self.handle = None
        try:
            buffer, handle = self._setup()
            error = None
        except Exception as e:       # a driver, a topology or a torch build without it
            buffer, handle, error = None, None, e
        if agree(buffer is not None, self.group, self.device):
            self.buffer, self.handle = buffer, handle
        elif error is not None:
            print(f"k3: symmetric-memory {self.op} off: {type(error).__name__}: {error}", file=sys.stderr)

    def _setup(self):
        """(this rank's buffer, the group's symmetric-memory handle); raises where it cannot."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
        return buffer, symm_mem.rendezvous(buffer, self.group_name)

    @property
    def active(self) -> bool:
        return self.buffer is not None

    def _holds(self, tensor, dtypes) -> bool:
        return (self.active and tensor.is_cuda and tensor.dtype in dtypes
                and tensor.numel() * tensor.element_size() <= self.max_bytes)

    def _stage(self, x: torch.Tensor) -> torch.Tensor:
        """x copied into this rank's buffer: [numel] of x.dtype."""
        staged = self.buffer.view(x.dtype)[: x.numel()]
        staged.copy_(x.reshape(-1))
        return staged


class SymmetricMemoryAllReduce(_SymmetricBuffer):
    """One-shot all-reduce over the group's symmetric buffers (module docstring)."""

    name = "nvidia.symm_mem_one_shot"
    op = "all_reduce"

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return op == "all_reduce" and self._holds(tensor, DTYPES)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks: a new tensor shaped like x."""
        out = torch.ops.symm_mem.one_shot_all_reduce(self._stage(x), "sum", self.group_name)
        return out.view(x.shape)


class SymmetricMemoryAllGather(_SymmetricBuffer):
    """All-gather by reading the peers' symmetric buffers (module docstring)."""

    name = "nvidia.symm_mem_all_gather"
    op = "all_gather"

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return op == "all_gather" and self._holds(tensor, GATHER_DTYPES)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation along dim in rank order: a new tensor (x's shape, world times along dim)."""
        self._stage(x)
        self.handle.barrier(channel=0)                  # every rank's input is in its buffer
        shape = tuple(x.shape)
        parts = [self.handle.get_buffer(r, (math.prod(shape),), x.dtype).view(shape) for r in range(self.world_size)]
        out = torch.cat(parts, dim=dim)                 # reads the peers' buffers
        self.handle.barrier(channel=0)                  # every rank has read: buffers may be written again
        return out


def backends_for(group, capabilities) -> list:
    """The NVIDIA collective backends for `group`: the symmetric-memory all-reduce and
    all-gather (each set up on every rank, or not used) when the platform has symmetric memory,
    the group is NCCL with several ranks and the environment opts in."""
    import torch.distributed as dist

    if not (enabled_by_env() and capabilities.symmetric_memory and dist.is_available() and dist.is_initialized()):
        return []
    group_or_world = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group_or_world) < 2 or dist.get_backend(group_or_world) != "nccl":
        return []
    backends = [SymmetricMemoryAllReduce(group_or_world), SymmetricMemoryAllGather(group_or_world)]
    return [b for b in backends if b.active]
