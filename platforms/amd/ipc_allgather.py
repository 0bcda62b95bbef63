"""The IPC all-gather: every rank copies its peers' shards straight out of their memory, mapped into
its own address space by IPC handles (HIP IPC on ROCm, CUDA IPC on NVIDIA: the same torch code),
instead of a ring of RCCL / NCCL steps. seed-notes.md: vLLM reports its HIP-IPC all-gather
53-61% faster than RCCL's on MI355X. **Never executed on a GPU** (no machine with two was lent):
off by default (K3_AMD_HIP_IPC=1 opts in, and then `hip_ipc` is claimed only where two GPUs
are visible); bench/ipc_allgather.py compares it with NCCL / RCCL's all-gather in one run; the
protocol runs on the CPU in tests over shared memory (ipc_transport.SharedMemoryIpc).

Set-up (once per group, collective): each rank allocates one buffer, a header of two int64
flag rows [2, W] followed by `capacity` data bytes, and the ranks exchange its handle
(all_gather_object) and open each other's; the ranks agree that every set-up succeeded (an
all-reduce), else none uses the backend. Call number e of all_gather(x), on rank r:

    1. wait until done[p] >= e - 1 in r's header for every peer p (they finished reading r's
       data of the previous call, so it may be overwritten);
    2. copy x's bytes into r's data; fence; write e into ready[r] of every rank's header; fence;
    3. wait until ready[p] >= e in r's header for every p (every shard of call e is published);
    4. copy every rank's shard from its data (peer memory, read directly) into the output,
       concatenated along `dim` in rank order (torch.distributed's all_gather + cat); fence;
    5. write e into done[r] of every rank's header.

Flags only grow, so a rank that runs ahead never mistakes an old flag for a new one. The waits
poll r's own header from the host (a fence, then a read; timeout_s raises naming the ranks
that never arrived): simple and the same on every transport, at the cost of host round trips
a device-side wait kernel would save (not written yet).
"""

from __future__ import annotations

import os
import time

import torch

from .ipc_transport import DeviceIpc

ENV = "K3_AMD_HIP_IPC"
CAPACITY = 64 << 20            # data bytes per rank: decode-sized and prefill-chunk-sized gathers
READY, DONE = 0, 1


def enabled_by_env() -> bool:
    """Opt-in: K3_AMD_HIP_IPC=1 (never executed on a GPU yet)."""
    return os.environ.get(ENV, "0") == "1"


class IpcAllGather:
    """`CollectiveBackend` for all_gather through IPC-mapped peer buffers (module docstring).

    group: an initialised process group (None: the default); transport: where buffers live
    (DeviceIpc of this rank's GPU by default; SharedMemoryIpc on the CPU in tests); capacity:
    data bytes per rank (larger gathers fall through to the next backend)."""

    name = "amd.ipc_all_gather"

    def __init__(self, group=None, transport=None, capacity: int = CAPACITY, timeout_s: float = 60.0):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.transport = transport or DeviceIpc(torch.device("cuda", torch.cuda.current_device()))
        self.capacity, self.timeout_s = capacity, timeout_s
        self.header = -(-2 * self.world * 8 // 256) * 256                      # flags, 256-byte aligned
        self.epoch = 0
        self.peers: list[torch.Tensor] = []
        error = None
        try:
            mine, handle = self.transport.allocate(self.header + capacity)
            handles = [None] * self.world
            dist.all_gather_object(handles, handle, group=self.group)
            self.peers = [mine if p == self.rank else self.transport.open(h) for p, h in enumerate(handles)]
        except Exception as e:               # a driver, a topology, a build without IPC
            error = e
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=self._agree_device())
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        self.active = bool(ok.item())
        self.reason = "" if self.active else f"set-up failed on some rank ({error or 'a peer'})"

    def _agree_device(self) -> torch.device:
        """Where the group's backend takes tensors (NCCL / RCCL: this rank's GPU; gloo: the CPU)."""
        import torch.distributed as dist

        return self.transport.device if dist.get_backend(self.group) in ("nccl", "rccl") else torch.device("cpu")

    def flags(self, rank: int) -> torch.Tensor:
        """int64 [2, W] header of `rank`'s buffer (READY row, DONE row), as mapped here."""
        return self.peers[rank][: 2 * self.world * 8].view(torch.int64).view(2, self.world)

    def data(self, rank: int, nbytes: int) -> torch.Tensor:
        return self.peers[rank][self.header: self.header + nbytes]

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return (op == "all_gather" and self.active and tensor.device == self.transport.device
                and tensor.numel() * tensor.element_size() <= self.capacity)

    def _signal(self, row: int, epoch: int) -> None:
        """Write `epoch` into flags[row][self.rank] of every rank's header, then fence."""
        for rank in range(self.world):
            self.flags(rank)[row, self.rank] = epoch
        self.transport.fence()

    def _wait(self, row: int, epoch: int) -> None:
        """Poll this rank's header until every rank's flag of `row` reached `epoch`."""
        mine = self.flags(self.rank)[row]
        deadline = time.monotonic() + self.timeout_s
        while True:
            seen = mine.cpu() if mine.device.type != "cpu" else mine.clone()
            if bool((seen >= epoch).all()):
                return
            if time.monotonic() > deadline:
                late = [p for p in range(self.world) if int(seen[p]) < epoch]
                step = "published call" if row == READY else "finished reading call"
                raise RuntimeError(f"{self.name}: rank(s) {late} never {step} {epoch} within {self.timeout_s} s "
                                   f"(rank {self.rank} waiting)")
            time.sleep(0)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (same shape and dtype on all ranks) concatenated along dim in rank order."""
        epoch = self.epoch + 1
        nbytes = x.numel() * x.element_size()
        self._wait(DONE, epoch - 1)                                            # 1. peers done with my data
        self.data(self.rank, nbytes).copy_(x.contiguous().view(-1).view(torch.uint8))
        self.transport.fence()
        self._signal(READY, epoch)                                             # 2. my shard is published
        self._wait(READY, epoch)                                               # 3. every shard is
        parts = [self.data(p, nbytes).view(x.dtype).view(x.shape) for p in range(self.world)]
        out = torch.cat(parts, dim=dim)                                        # 4. read peers' memory
        self.transport.fence()
        self._signal(DONE, epoch)                                              # 5. done reading
        self.epoch = epoch
        return out

    def close(self) -> None:
        """Release the buffers (collective: a barrier first, so no peer still reads them)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)
        self.peers = []
        self.transport.close()
