"""Where the IPC all-gather's buffers live (ipc_allgather.py): memory a rank allocates and its
peers map into their own address space through a picklable handle.

- `DeviceIpc`: GPU memory shared through torch's CUDA IPC (`torch.multiprocessing.reductions.
  reduce_tensor`: cudaIpcGetMemHandle on CUDA builds, hipIpcGetMemHandle on ROCm builds; the
  handle rebuilds the tensor in another process of the same node).
- `SharedMemoryIpc`: the CPU stand-in for tests, POSIX shared memory
  (`multiprocessing.shared_memory`), same protocol, no GPU.
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import torch


class DeviceIpc:
    """Buffers in this rank's GPU memory, opened by peers through CUDA / HIP IPC handles."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, object]:
        """(uint8 [nbytes] zeroed buffer on the device, picklable handle)."""
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return buffer, reduce_tensor(buffer)

    def open(self, handle) -> torch.Tensor:
        """A peer's buffer mapped into this process (device memory of the peer's GPU)."""
        rebuild, args = handle
        return rebuild(*args)

    def fence(self) -> None:
        """Wait until this rank's queued device work (copies, flag writes) is done and visible."""
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        pass


class SharedMemoryIpc:
    """Buffers in POSIX shared memory: the CPU stand-in of DeviceIpc (tests of the protocol)."""

    device = torch.device("cpu")

    def __init__(self):
        self._created: list[shared_memory.SharedMemory] = []
        self._opened: list[shared_memory.SharedMemory] = []     # kept mapped while tensors view them

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, object]:
        segment = shared_memory.SharedMemory(create=True, size=nbytes)
        self._created.append(segment)
        buffer = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
        buffer.zero_()
        return buffer, (segment.name, nbytes)

    def open(self, handle) -> torch.Tensor:
        name, nbytes = handle
        segment = shared_memory.SharedMemory(name=name)
        # the creator unlinks it (close); without this, this process's resource tracker would too
        resource_tracker.unregister(segment._name, "shared_memory")
        self._opened.append(segment)
        return torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)

    def fence(self) -> None:
        pass                                  # CPU copies are done when they return

    def close(self) -> None:
        """Unlink the segments this rank created (call after the group's last use: every peer
        has mapped them by then; the mappings themselves go with the processes)."""
        for segment in self._created:
            segment.unlink()
        self._created.clear()
