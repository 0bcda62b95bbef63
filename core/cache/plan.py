"""The packed hybrid cache plan (DESIGN.md "Decisions": Cache rows, Four sizes).

One pool of equal-size rows in one backing tensor with a fixed stride. A row serves either as
an attention row (for every full-attention layer, the latent page and the DSA index-key page
of the block's tokens) or as a state row (one request's KDA state: recurrent and conv state of
every KDA layer on this rank). The block size in tokens is a power of two, by default the
smallest whose attention row can hold a state. A request holds ceil(len / block) attention
rows plus one running state row; prefix-caching checkpoints and speculative decoding add state
rows, planned up front. Kernels never see the row format: they get per-layer views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3.config import K3Config

from .records import index_record_bytes, kda_state_region_sizes, latent_record_bytes


@dataclass(frozen=True)
class Region:
    """A named byte range inside a row."""

    name: str          # e.g. "layer3.latent", "layer0.recurrent"
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RowLayout:
    """Row format: attention-row regions, state-row regions, and the common stride."""

    block_size: int
    attention_regions: tuple[Region, ...]
    state_regions: tuple[Region, ...]
    row_bytes: int                    # stride: max of both uses, rounded up to the alignment

    @property
    def attention_bytes(self) -> int:
        return sum(r.nbytes for r in self.attention_regions)

    @property
    def state_bytes(self) -> int:
        return sum(r.nbytes for r in self.state_regions)


def attention_region_sizes(cfg: K3Config, block_size: int, kv_cache_dtype: str,
                           index_cache_dtype: str) -> list[tuple[str, int]]:
    """(name, bytes) of each MLA layer's latent page and index-key page for one block."""
    out = []
    for layer in cfg.mla_layer_ids:
        out.append((f"layer{layer}.latent", block_size * latent_record_bytes(cfg, kv_cache_dtype)))
        if cfg.uses_dsa:
            out.append((f"layer{layer}.index_key", block_size * index_record_bytes(cfg, index_cache_dtype)))
    return out


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _regions(sizes: list[tuple[str, int]], alignment: int) -> tuple[Region, ...]:
    regions, at = [], 0
    for name, nbytes in sizes:
        regions.append(Region(name, at, nbytes))
        at = _align(at + nbytes, alignment)
    return tuple(regions)


def default_block_size(cfg: K3Config, *, tensor_parallel_size: int, kv_cache_dtype: str,
                       index_cache_dtype: str, activation_dtype: str | None = None) -> int:
    """Smallest power of two whose attention row can hold one KDA state row."""
    state = sum(n for _, n in kda_state_region_sizes(cfg, tensor_parallel_size, activation_dtype))
    per_token = sum(n for _, n in attention_region_sizes(cfg, 1, kv_cache_dtype, index_cache_dtype))
    if per_token == 0:
        return 1
    return 1 << max(0, math.ceil(math.log2(max(1, state / per_token))))


def row_layout(cfg: K3Config, *, block_size: int, tensor_parallel_size: int, kv_cache_dtype: str,
               index_cache_dtype: str, activation_dtype: str | None = None, alignment: int = 256) -> RowLayout:
    """The row format for a block size (regions aligned to `alignment` bytes)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two, got {block_size}")
    attention = _regions(attention_region_sizes(cfg, block_size, kv_cache_dtype, index_cache_dtype), alignment)
    state = _regions(kda_state_region_sizes(cfg, tensor_parallel_size, activation_dtype), alignment)
    end = max([r.offset + r.nbytes for r in attention + state] or [0])
    return RowLayout(block_size=block_size, attention_regions=attention, state_regions=state,
                     row_bytes=_align(max(end, 1), alignment))
