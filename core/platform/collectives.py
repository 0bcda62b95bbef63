"""Collective backends: the dispatcher the model's parallel context calls, and the
torch.distributed backend the reference plugin puts last.

A backend written before an op existed (all_to_all_single came with expert parallelism) may
accept every op without implementing the new one: the dispatcher passes over a backend that
lacks the op's method, so such a plugin keeps working and the op falls through to the next."""

from __future__ import annotations

import torch

from k3.model.parallel import Splits, TorchDistributedCollectives


class DispatchingCollectives:
    """Collectives that hand each call to the first backend accepting it."""

    def __init__(self, backends: list):
        if not backends:
            raise ValueError("no collective backend: the reference torch.distributed backend is missing")
        self.backends = backends

    def _pick(self, op: str, x: torch.Tensor):
        for backend in self.backends:
            if hasattr(backend, op) and backend.accepts(op, x):
                return backend
        raise RuntimeError(f"no collective backend accepts {op} on a {x.dtype} tensor of shape {tuple(x.shape)}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick("all_reduce", x).all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self._pick("all_gather", x).all_gather(x, dim)

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: Splits = None,
                          input_split_sizes: Splits = None) -> torch.Tensor:
        return self._pick("all_to_all_single", x).all_to_all_single(x, output_split_sizes, input_split_sizes)


class TorchDistributedBackend(TorchDistributedCollectives):
    """torch.distributed collectives (gloo on the CPU, NCCL/RCCL on GPUs): accepts everything."""

    name = "torch.distributed"

    def accepts(self, op: str, tensor: torch.Tensor) -> bool:
        return True
