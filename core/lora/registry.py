"""The loaded LoRA adapters: names, slots of the model's `LoRAState`, and the prefix-cache salt
of each load (two adapters, or two loads under one name, never share cached prefixes).

A slot is reused only when no live request still runs on it (`in_use`): an adapter unloaded
while requests run on it keeps its weights until they finish.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k3.model.lora import LoRAState

from .peft_format import read_peft_adapter

__all__ = ["LoRAError", "LoRANotFound", "LoRARegistry", "LoadedAdapter"]


class LoRAError(ValueError):
    """A load or unload the registry refuses (a bad request: HTTP 400)."""


class LoRANotFound(LoRAError):
    """No adapter of that name is loaded (HTTP 404)."""


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    slot: int
    rank: int
    scale: float
    salt: bytes          # the prefix-cache salt of this load


class LoRARegistry:
    """state: the model's slots (`k3.model.lora.attach_lora`); in_use: the slots live requests
    run on (the engine's)."""

    def __init__(self, state: LoRAState, *, in_use: Callable[[], set[int]] = set):
        self.state, self._in_use = state, in_use
        self.adapters: dict[str, LoadedAdapter] = {}
        self._loads = itertools.count(1)
        self._dirty: set[int] = set()       # slots unloaded but maybe still running

    def load(self, name: str, path: str | Path) -> LoadedAdapter:
        """Read and check the PEFT adapter at `path` and put it in a free slot under `name`."""
        if not name or not isinstance(name, str):
            raise LoRAError("lora_name must be a non-empty string")
        if name in self.adapters:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        adapter = read_peft_adapter(path, self.state.targets, max_rank=self.state.max_rank)
        busy = {a.slot for a in self.adapters.values()} | (self._dirty & self._in_use())
        free = [s for s in range(self.state.max_loras) if s not in busy]
        if not free:
            raise LoRAError(f"every one of the {self.state.max_loras} LoRA slots (--max-loras) holds an adapter "
                            "(or runs requests of an unloaded one): unload one first")
        slot = free[0]
        self.state.clear(slot)
        self._dirty.discard(slot)
        for (target, expert), (a, b) in adapter.weights.items():
            self.state.write(slot, target, a, b, expert)
        self.state.set_scale(slot, adapter.scale)
        loaded = LoadedAdapter(name, str(path), slot, adapter.rank, adapter.scale,
                               f"lora\0{name}\0{next(self._loads)}".encode())
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> LoadedAdapter:
        """Forget `name`; its slot is reused once no request runs on it."""
        loaded = self.adapters.pop(name, None)
        if loaded is None:
            raise LoRANotFound(f"The lora adapter '{name}' cannot be found.")
        self._dirty.add(loaded.slot)
        return loaded

    def get(self, name: str) -> LoadedAdapter:
        loaded = self.adapters.get(name)
        if loaded is None:
            raise LoRANotFound(f"The model `{name}` does not exist.")
        return loaded
