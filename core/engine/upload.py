"""Step tensors built on the host and copied to the device in one transfer per dtype.

A decode step's metadata is a dozen small int tensors; made one by one with
`torch.tensor(values, device=...)`, each is its own host-to-device copy, and a copy from pageable
memory also waits for the device stream. `HostBatch` gathers them and copies each dtype's values
in one tensor; the fields are views into it, each starting 16 bytes from the last (so kernels
that specialise on aligned pointers see aligned ones).
"""

from __future__ import annotations

import itertools

import torch

_ALIGN_BYTES = 16


class HostBatch:
    """Collect named host values, then `upload(device)` them: {name: device tensor}."""

    def __init__(self):
        self._groups: dict[torch.dtype, list[tuple[str, list, tuple[int, ...]]]] = {}

    def add(self, name: str, values, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> None:
        """values: a flat list of numbers, or a list of equal-length lists (shape [rows, cols]);
        shape: the tensor's shape when it is neither (its element count must match)."""
        values = list(values)
        if values and isinstance(values[0], (list, tuple)):
            rows, cols = len(values), len(values[0])
            values = list(itertools.chain.from_iterable(values))
            shape = shape or (rows, cols)
        shape = shape or (len(values),)
        if len(values) != (n := int(torch.Size(shape).numel())):
            raise ValueError(f"HostBatch.add({name!r}): {len(values)} values for shape {shape} ({n} elements)")
        self._groups.setdefault(dtype, []).append((name, values, tuple(shape)))

    def upload(self, device, *, pinned: bool = False) -> dict[str, torch.Tensor]:
        """pinned: stage the values in page-locked host memory and copy without blocking (a copy
        from pageable memory first waits for everything queued on the device's stream, which
        would stall a step launched while the previous one runs)."""
        out: dict[str, torch.Tensor] = {}
        for dtype, items in self._groups.items():
            step = max(1, _ALIGN_BYTES // dtype.itemsize)
            flat, offsets = [], []
            for _, values, _ in items:
                offsets.append(len(flat))
                flat += values
                flat += [0] * (-len(values) % step)
            host = torch.tensor(flat, dtype=dtype)
            device_values = host.pin_memory().to(device, non_blocking=True) if pinned else host.to(device)
            for (name, values, shape), offset in zip(items, offsets):
                out[name] = device_values[offset: offset + len(values)].view(shape)
        return out
