"""Seeded sample inputs and the plumbing around them (clone, upcast, move, poison).

Sample generators draw float64 values from a seeded CPU generator and cast them to the
kernel's dtype, so every dtype of a sample sees the same underlying values and the oracle sees
exactly the kernel's inputs upcast to float64. Values are never all zeros. Buffers a kernel
writes into are NaN-poisoned by the generator (`poisoned`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.dtypes import DTYPES
from k3.quant.mxfp4 import MXFP4Tensor

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
TORCH_DTYPES = DTYPES        # the dtype names items carry (k3.dtypes)


@dataclass
class Inputs:
    """Positional and keyword arguments of one kernel call."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute / state dtype paired with an activation dtype (fp32, fp64 for float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def randn(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


def uniform(gen: torch.Generator, shape: Sequence[int], lo: float, hi: float, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def poisoned(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """NaN everywhere (0xFF bytes for uint8, whose E8M0 reading is NaN too)."""
    if dtype == torch.uint8:
        return torch.full(tuple(shape), 255, dtype=dtype)
    return torch.full(tuple(shape), float("nan"), dtype=torch.float32).to(dtype)


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(lengths)).cumsum(0)
    return cu


def l2_normalised(gen, shape, dtype) -> torch.Tensor:
    x = torch.randn(tuple(shape), generator=gen, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).to(dtype)


def causal_topk(gen: torch.Generator, q_pos: Sequence[int], k: int) -> torch.Tensor:
    """int32 [T, k]: for a query at position p, a random subset of [0, p] of size min(k, p+1)
    in random order, -1 padded (what a DSA indexer hands MLA)."""
    rows = []
    for p in q_pos:
        pick = torch.randperm(p + 1, generator=gen)[: min(k, p + 1)]
        rows.append(torch.cat([pick, torch.full((k - pick.numel(),), -1, dtype=torch.long)]))
    return torch.stack(rows).to(torch.int32)


def shuffled_pages(gen: torch.Generator, seq_lens: Sequence[int], page_size: int, spare: int = 3
                   ) -> tuple[torch.Tensor, int, int]:
    """A shuffled block table for sequences of seq_lens: (table int32 [N, max_pages], number of
    pages P, a spare page id no sequence uses, for padding the table and poisoning)."""
    need = [-(-n // page_size) for n in seq_lens]
    max_pages = max(need)
    total = sum(need) + spare
    perm = torch.randperm(total, generator=gen)
    pad = int(perm[-1])                                 # never a sequence's page
    table = torch.full((len(seq_lens), max_pages), pad, dtype=torch.int32)
    at = 0
    for n, count in enumerate(need):
        table[n, :count] = perm[at: at + count].to(torch.int32)
        at += count
    return table, total, pad


def tree_map(fn: Callable[[torch.Tensor], Any], obj, leaf: Callable[[Any], Any] | None = None):
    """fn applied to every tensor inside tuples, lists, dicts, Inputs and MXFP4Tensors (their
    layout class kept: a tile-major stack stays one), `leaf`, when given, to every other leaf."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, MXFP4Tensor):
        return type(obj)(fn(obj.packed), fn(obj.scales), obj.shape)
    if isinstance(obj, Inputs):
        return Inputs(tree_map(fn, obj.args, leaf), tree_map(fn, obj.kwargs, leaf))
    if isinstance(obj, tuple):
        return tuple(tree_map(fn, x, leaf) for x in obj)
    if isinstance(obj, list):
        return [tree_map(fn, x, leaf) for x in obj]
    if isinstance(obj, dict):
        return {k: tree_map(fn, v, leaf) for k, v in obj.items()}
    return obj if leaf is None else leaf(obj)


def clone(obj):
    return tree_map(lambda t: t.clone(), obj)


def upcast64(obj):
    """The oracle's copy of the inputs: floating tensors (not fp8) in float64, and dtype
    arguments naming an activation dtype (`dequantize(..., dtype=torch.bfloat16)`) float64."""
    def dtype_arg(x):
        return torch.float64 if isinstance(x, torch.dtype) and x in TORCH_DTYPES.values() else x

    return tree_map(lambda t: t.double() if t.is_floating_point() and t.dtype not in FP8 else t.clone(), obj,
                    dtype_arg)


def to_device(obj, device):
    return tree_map(lambda t: t.to(device), obj)


def to_cpu(obj):
    return tree_map(lambda t: t.detach().cpu(), obj)


def poison_freed_memory(device) -> None:
    """On devices with a caching allocator (CUDA and ROCm), fill the allocator's free memory
    with NaN: allocate a large NaN tensor and free it, so a kernel that reads memory it did not
    write shows NaN instead of stale values."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return
    free, _ = torch.cuda.mem_get_info(dev)
    n = min(free // 4, 1 << 30) // 4
    if n > 0:
        block = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
        del block


def synchronize(device) -> None:
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)
