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
from typing import TYPE_CHECKING

from k3.config import K3Config

from .records import index_record_bytes, kda_state_region_sizes, latent_record_bytes

if TYPE_CHECKING:
    from .format import CacheFormat


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


def speculative_scratch_rows(cfg: K3Config, *, max_num_seqs: int, num_speculative_tokens: int,
                             kda_rollback: str = "states") -> int:
    """State rows speculative decoding reserves up front: with the "states" rollback each
    running request verifies k tokens into 1 + k scratch rows (the state before and after
    each draft token), so max_num_seqs x (1 + k); "recover" keeps its records outside the
    pool, and a model without KDA layers needs none."""
    if not num_speculative_tokens or kda_rollback != "states" or not cfg.kda_layer_ids:
        return 0
    return max_num_seqs * (1 + num_speculative_tokens)


def prefix_checkpoint_rows_per_chunk(cfg: K3Config, chunk_tokens: int, *, interval: int) -> int:
    """Rows one prefill chunk takes for the KDA checkpoints it emits (every `interval` tokens,
    plus the prompt's last full unit); 0 for a model without KDA layers."""
    if not cfg.kda_layer_ids:
        return 0
    return (chunk_tokens // interval if interval else 0) + 1


@dataclass(frozen=True)
class CachePlan:
    """Every row of one rank's cache, assigned at start-up, in this order:

    [0, token_rows):   the BlockPool: attention rows, each request's running state row, and
                       prefix-cache checkpoints (no reservation: a checkpoint takes a row from
                       the token rows, evicted least-recently-used; one prefill chunk takes up
                       to `prefix_checkpoint_rows_per_chunk` of them as it runs);
    graph_scratch_row: the padding sequences of captured decode graphs (None: no graphs);
    spec_rows:         the "states" rollback's scratch rows, max_num_seqs x (1 + k).
    Beside the rows, the "recover" rollback keeps `record_slots` x `record_tokens` KDA records.
    max_model_len: the longest request (prompt + output) the token rows hold one of.
    """

    layout: RowLayout
    num_rows: int
    token_rows: int
    graph_scratch_row: int | None
    spec_rows: range
    record_slots: int
    record_tokens: int
    max_model_len: int
    prefix_checkpoint_rows_per_chunk: int = 0

    @property
    def block_size(self) -> int:
        return self.layout.block_size


def plan_cache(cfg: K3Config, fmt: "CacheFormat", *, cache_bytes: int, max_num_seqs: int,
               max_model_len: int | None = None, num_speculative_tokens: int = 0, kda_rollback: str = "states",
               graph_scratch: bool = False, prefix_chunk_tokens: int = 0, kda_checkpoint_interval: int = 0,
               strict: bool = True) -> CachePlan:
    """The rows of a `cache_bytes` cache in `fmt` (see CachePlan). prefix_chunk_tokens: the
    largest prefill chunk when prefix caching is on (0: off). strict: refuse a plan whose
    speculative scratch rows take every row (the capacity report only notes it)."""
    layout = fmt.layout(cfg)
    rows = cache_bytes // layout.row_bytes
    spec = speculative_scratch_rows(cfg, max_num_seqs=max_num_seqs, num_speculative_tokens=num_speculative_tokens,
                                    kda_rollback=kda_rollback)
    if strict and spec and spec >= rows:
        raise ValueError(f"the cache holds {rows} rows, too few for the {spec} speculative scratch rows of "
                         f"max_num_seqs {max_num_seqs} x (1 + {num_speculative_tokens}): give it more memory, lower "
                         "max_num_seqs, or use kda_rollback \"recover\"")
    scratch = 1 if graph_scratch else 0
    token_rows = rows - spec - scratch
    recover = bool(num_speculative_tokens) and kda_rollback == "recover"
    limit = cfg.max_position_embeddings
    return CachePlan(
        layout=layout, num_rows=rows, token_rows=token_rows,
        graph_scratch_row=token_rows if scratch else None, spec_rows=range(rows - spec, rows),
        record_slots=max_num_seqs if recover else 0, record_tokens=num_speculative_tokens + 1 if recover else 0,
        max_model_len=min(max_model_len or limit, limit, (token_rows - 1) * layout.block_size),
        prefix_checkpoint_rows_per_chunk=prefix_checkpoint_rows_per_chunk(cfg, prefix_chunk_tokens,
                                                                          interval=kda_checkpoint_interval)
        if prefix_chunk_tokens else 0)


def draft_cache_rows(fmt: "CacheFormat", *, max_model_len: int, max_num_seqs: int,
                     num_speculative_tokens: int) -> int:
    """Rows of a draft model's own cache (in its `fmt`): per request the attention rows of a
    max-length request, its running state row and k scratch states (one after each draft)."""
    return max_num_seqs * (math.ceil(max_model_len / fmt.block_size) + 1 + num_speculative_tokens)
