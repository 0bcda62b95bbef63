"""Base module: parameters that know which checkpoint tensor (and which shard of it) fills them.

Every parameter of the K3 graph is registered with a `WeightSpec`: the checkpoint tensor name
(relative to the module), the tensor's full shape in the checkpoint, the slice of it this rank
holds, and where that slice lands in the (possibly fused or stacked) parameter. The loader
reads exactly those slices; `k3 info` counts parameters from the same specs, so the two can
never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightSpec:
    """Where one checkpoint tensor goes.

    checkpoint_name: tensor name relative to the owning module ("q_proj.weight").
    param: attribute name of the destination parameter or buffer on the owning module.
    full_shape: the tensor's shape in the checkpoint (all ranks together).
    shard: (dim, start, size) of the checkpoint tensor this rank reads, or None for all of it.
    dest: index into the destination (a tuple of ints / slices), () for the whole parameter.
    alt_shapes: other checkpoint shapes accepted for the same data (reshaped to full_shape),
        e.g. a legacy A_log [1, 1, H, 1] or a 2-D conv weight.
    logical_per_element: logical parameters per stored element: 2 for packed FP4 bytes,
        0 for quantisation scales, 1 otherwise.
    stack: (total, local_start, local_count) for a stacked expert weight: the checkpoint holds
        `total` tensors named with "{expert}" in checkpoint_name, each of full_shape; this rank
        stores global experts [local_start, local_start + local_count) along the parameter's
        axis 0, expert e at dest (e - local_start, *dest).
    dims: per dimension of full_shape, the config fields that set it, as an expression
        ("linear_attn_config.num_heads * linear_attn_config.head_dim"); () when not stated.
        A shape error names them (`k3.checkpoint.loader`).
    """

    checkpoint_name: str
    param: str
    full_shape: tuple[int, ...]
    shard: tuple[int, int, int] | None = None
    dest: tuple = ()
    alt_shapes: tuple[tuple[int, ...], ...] = ()
    logical_per_element: int = 1
    stack: tuple[int, int, int] | None = None
    dims: tuple[str, ...] = ()

    @property
    def logical_numel(self) -> int:
        """Logical parameters of every checkpoint tensor this spec covers (all experts)."""
        n = 1
        for s in self.full_shape:
            n *= s
        return n * self.logical_per_element * (self.stack[0] if self.stack else 1)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the slice this rank reads."""
        if self.shard is None:
            return self.full_shape
        dim, _, size = self.shard
        return tuple(size if i == dim else s for i, s in enumerate(self.full_shape))


class K3Module(nn.Module):
    """nn.Module whose parameters carry WeightSpecs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._weight_specs: list[WeightSpec] = []

    def add_weight(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device,
        *,
        checkpoint: str | None = None,
        full_shape: tuple[int, ...] | None = None,
        shard: tuple[int, int, int] | None = None,
        alt_shapes: tuple[tuple[int, ...], ...] = (),
        buffer: bool = False,
        sources: list[WeightSpec] | None = None,
        dims: tuple[str, ...] = (),
    ) -> torch.Tensor:
        """Register an uninitialised parameter (or buffer) `name` of local `shape`.

        By default one checkpoint tensor fills it: `checkpoint` (default `name` + ".weight"),
        of `full_shape` (default `shape`: replicated), of which this rank reads `shard`.
        A fused or stacked parameter passes its `sources` (WeightSpecs whose `param` is
        `name`) instead. dims: the config fields behind each dimension (`WeightSpec.dims`).
        """
        t = torch.empty(shape, dtype=dtype, device=device)
        if buffer:
            self.register_buffer(name, t, persistent=False)
        else:
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        if sources is None:
            sources = [WeightSpec(checkpoint_name=checkpoint if checkpoint is not None else f"{name}.weight",
                                  param=name, full_shape=tuple(full_shape or shape), shard=shard,
                                  alt_shapes=alt_shapes, dims=dims)]
        self._weight_specs.extend(sources)
        return getattr(self, name)

    def add_fused_weight(self, name: str, parts: list[tuple], dtype: torch.dtype, device, *,
                         alt_shapes: tuple[tuple[int, ...], ...] = ()) -> tuple[int, ...]:
        """Register `name`: the concatenation along axis 0 of the checkpoint tensors `parts`, each
        (checkpoint name, full shape [rows, ...], this rank's shard (0, start, rows) or None for
        all of it[, dims: the config fields behind each dimension]), so one matrix product
        computes all of their outputs; every part has the same trailing shape and accepts
        `alt_shapes`. Returns the local row count of each part, in order (for `torch.split` of
        the product's last dimension)."""
        rows = [part[2][2] if part[2] else part[1][0] for part in parts]
        bounds = [0]
        for count in rows:
            bounds.append(bounds[-1] + count)
        self.add_weight(name, (bounds[-1], *parts[0][1][1:]), dtype, device, sources=[
            WeightSpec(part[0], name, part[1], shard=part[2], dest=(slice(start, end),),
                       alt_shapes=alt_shapes, dims=part[3] if len(part) > 3 else ())
            for part, start, end in zip(parts, bounds, bounds[1:])])
        return tuple(rows)

    def weight_specs(self, prefix: str = "") -> Iterator[tuple[str, str, WeightSpec]]:
        """(checkpoint name, qualified parameter name, spec) for this module and its children."""
        for spec in self._weight_specs:
            yield prefix + spec.checkpoint_name, prefix + spec.param, spec
        for child_name, child in self.named_children():
            if isinstance(child, K3Module):
                yield from child.weight_specs(f"{prefix}{child_name}.")
            elif isinstance(child, nn.ModuleList):
                for i, sub in enumerate(child):
                    yield from sub.weight_specs(f"{prefix}{child_name}.{i}.")

