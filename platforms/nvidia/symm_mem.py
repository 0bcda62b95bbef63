"""The "NVLink mailbox" all-reduce: a one-shot all-reduce through torch symmetric memory.

Every rank of a group owns one symmetric buffer (`torch.distributed._symmetric_memory.empty`,
mapped into every peer's address space after `rendezvous`). A decode-sized all-reduce copies
its input into the rank's buffer and runs `torch.ops.symm_mem.one_shot_all_reduce`: each rank
reads every peer's buffer over NVLink and sums locally, one kernel and no NCCL ring, which is
what makes small decode all-reduces (a few KiB to a few MiB) faster than NCCL's.

The backend is a `k3.plugin.types.CollectiveBackend`: it accepts only all-reduces of CUDA
tensors it can hold (float16 / bfloat16 / float32, at most `max_bytes`) and declines the rest,
which fall through to torch.distributed (NCCL). Set up only when the platform reports
`symmetric_memory`, the group has more than one rank on NCCL, and every rank's set-up
succeeded (agreed by an all-reduce, so no rank uses it alone); `K3_NVIDIA_SYMM_MEM=0` turns it
off. Not measured on several GPUs yet (BENCHMARKS.md): opt-in until then
(`K3_NVIDIA_SYMM_MEM=1`).
"""

from __future__ import annotations

import os
import sys

import torch

ENV = "K3_NVIDIA_SYMM_MEM"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# per-world-size buffer sizes where one-shot beats NCCL on NVLink (the ranges others report);
# larger all-reduces (prefill) go to NCCL
MAX_BYTES = {2: 8 << 20, 4: 8 << 20, 8: 4 << 20}


def enabled_by_env() -> bool:
    """Opt-in for now: K3_NVIDIA_SYMM_MEM=1 (0 or unset: off)."""
    return os.environ.get(ENV, "0") == "1"


class SymmetricMemoryAllReduce:
    """One-shot all-reduce over a group's symmetric buffers (see the module docstring).

    group: an initialised NCCL process group (None: the default group); device: this rank's
    CUDA device; max_bytes: the buffer size (default MAX_BYTES by world size)."""

    name = "nvidia.symm_mem_one_shot"

    def __init__(self, group=None, device=None, max_bytes: int | None = None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.max_bytes = max_bytes or MAX_BYTES.get(self.world_size, 4 << 20)
        self.buffer: torch.Tensor | None = None
        self.group_name = self.group.group_name
        error = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
            symm_mem.rendezvous(buffer, self.group_name)
        except Exception as e:       # a driver, a topology or a torch build without it
            buffer, error = None, e
        ok = torch.tensor([0 if buffer is None else 1], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)   # all ranks or none
        if ok.item():
            self.buffer = buffer
        elif error is not None:
            print(f"k3: symmetric-memory all-reduce off: {type(error).__name__}: {error}", file=sys.stderr)

    @property
    def active(self) -> bool:
        return self.buffer is not None

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return (op == "all_reduce" and self.active and tensor.is_cuda and tensor.dtype in DTYPES
                and tensor.numel() * tensor.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group's ranks: a new tensor shaped like x."""
        n = x.numel()
        staged = self.buffer.view(x.dtype)[:n]                 # [n] this rank's mailbox
        staged.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        return out.view(x.shape)


def backends_for(group, capabilities) -> list:
    """The NVIDIA collective backends for `group`: the symmetric-memory all-reduce when the
    platform has it, the group is NCCL with several ranks and the environment opts in."""
    import torch.distributed as dist

    if not (enabled_by_env() and capabilities.symmetric_memory and dist.is_available() and dist.is_initialized()):
        return []
    group_or_world = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group_or_world) < 2 or dist.get_backend(group_or_world) != "nccl":
        return []
    backend = SymmetricMemoryAllReduce(group_or_world)
    return [backend] if backend.active else []
