"""Model layers as conformance subjects: the same layer with the platform's kernels (in the
item's dtype, on the platform device) and with the reference kernels in float64 on the CPU,
holding the same random weights, so cache-view paths are checked exactly as the model drives
them.
"""

from __future__ import annotations

import dataclasses

import torch

from k3.checkpoint.random_init import random_tensor
from k3.model import reference_kernels


def init_random(module, cfg, *, seed: int, prefix: str = "") -> None:
    """Fill a K3Module with the random-checkpoint weights its checkpoint names would get."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    for template, param_name, spec in module.weight_specs():
        param = tensors[param_name]
        name = prefix + template
        t = random_tensor(name, spec.full_shape, torch.uint8 if param.dtype == torch.uint8 else torch.float32,
                          seed=seed, name=name, cfg=cfg)
        target = param[spec.dest] if spec.dest else param
        target.copy_(t.reshape(target.shape).to(param.dtype))


def twin_layers(build, cfg, *, kernels, dtype: torch.dtype, device, seed: int, prefix: str,
                oracle_kernels=None):
    """(platform layer, reference layer): build(cfg, kernels=..., dtype=..., device=...) twice;
    the reference (reference kernels, float64, CPU) holds the platform layer's rounded weights
    upcast to float64."""
    layer = build(cfg, kernels=kernels, dtype=dtype, device="cpu")
    init_random(layer, cfg, seed=seed, prefix=prefix)
    oracle = build(cfg, kernels=oracle_kernels or reference_kernels(), dtype=torch.float64, device="cpu")
    with torch.no_grad():
        theirs = dict(oracle.named_parameters())
        theirs.update(oracle.named_buffers())
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            theirs[name].copy_(t.to(theirs[name].dtype) if t.is_floating_point() else t)
    return layer.to(device), oracle


class Capture:
    """Wraps kernel entries so their last outputs can be read back ("indexer.scores" -> tensor)."""

    def __init__(self):
        self.seen: dict[str, object] = {}
        self.last: str | None = None             # the entry called most recently

    def wrap(self, kernels, entries: list[str]):
        """A copy of the KernelSet with `entries` ("family.entry") recording their outputs."""
        tables = {}
        for entry in entries:
            family, name = entry.split(".", 1)
            table = tables.get(family, getattr(kernels, family))
            fn = getattr(table, name, None)
            if fn is None:
                continue
            tables[family] = dataclasses.replace(table, **{name: self._recording(entry, fn)})
        return dataclasses.replace(kernels, **tables)

    def _recording(self, entry, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.seen[entry], self.last = out, entry
            return out
        return call
