"""Capacity of the packed cache for a memory budget: every term of the sum, stated.

usable = HBM per GPU x gpu_memory_utilization
cache  = usable - weights per GPU (from the config and its quantisation, exact per rank)
                - workspace (fixed 2 GiB + the prefill activations of one token budget,
                  the AttnRes block bank included)
rows   = cache // row_bytes
A max-length request needs ceil(max_len / (block x DCP)) attention rows plus its state rows
(1 running + speculation), so concurrent = rows // that; the token capacity is what the
attention rows left after those state rows hold, times DCP (each DCP rank stores every
DCP-th token).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from k3.config import K3Config

from .plan import RowLayout, default_block_size, row_layout
from .records import attention_bytes_per_token, kda_state_bytes

GIB = 1024 ** 3
FIXED_WORKSPACE = 2 * GIB
DEFAULT_GPU_MEMORY_GIB = 80.0


@dataclass(frozen=True)
class CapacityReport:
    bytes_per_token_per_gpu: int
    state_bytes_per_request: int
    block_size: int
    row_bytes: int
    attention_row_padding: int       # bytes of a row unused when it holds a block's attention pages
    state_row_padding: int           # bytes unused when it holds a KDA state
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int
    weight_bytes_per_gpu: int
    workspace_bytes: int
    cache_bytes: int
    num_rows: int
    max_model_len: int
    state_rows_per_request: int
    rows_per_max_len_request: int
    concurrent_max_len_requests: int
    capacity_tokens: int
    tensor_parallel_size: int
    decode_context_parallel_size: int
    kv_cache_dtype: str
    index_cache_dtype: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes_per_gpu(cfg: K3Config, tensor_parallel_size: int) -> int:
    """Exact bytes of rank 0's parameters and buffers (meta device: nothing is allocated)."""
    from k3.model import K3ForCausalLM, ParallelContext

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float64": torch.float64}[cfg.dtype]
    model = K3ForCausalLM(cfg, parallel=ParallelContext(rank=0, world_size=tensor_parallel_size),
                          dtype=dtype, device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def workspace_bytes(cfg: K3Config, max_num_batched_tokens: int) -> int:
    """Fixed workspace plus one token budget of prefill activations (AttnRes bank + a few
    hidden-sized temporaries per token)."""
    per_token = cfg.hidden_size * 2 * (cfg.num_attn_res_blocks + 6)
    return FIXED_WORKSPACE + max_num_batched_tokens * per_token


def plan_capacity(cfg: K3Config, *, kv_cache_dtype: str = "bf16", index_cache_dtype: str = "fp8",
                  tensor_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                  gpu_memory_bytes: int = int(DEFAULT_GPU_MEMORY_GIB * GIB), gpu_memory_utilization: float = 0.9,
                  max_model_len: int | None = None, block_size: int | None = None,
                  max_num_batched_tokens: int = 8192, spec_state_rows_per_request: int = 0,
                  alignment: int = 256) -> CapacityReport:
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ValueError(f"decode context parallel size {dcp} must divide tensor parallel size {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    max_len = max_model_len or cfg.max_position_embeddings
    if block_size is None:
        block_size = default_block_size(cfg, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype,
                                        index_cache_dtype=index_cache_dtype)
    layout: RowLayout = row_layout(cfg, block_size=block_size, tensor_parallel_size=tp,
                                   kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
                                   alignment=alignment)
    notes = []
    if layout.state_bytes > layout.attention_bytes:
        notes.append(f"block size {block_size} leaves attention rows {layout.state_bytes - layout.attention_bytes:,} "
                     "bytes short of a state: rows are sized for the state")
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    weights = weight_bytes_per_gpu(cfg, tp)
    workspace = workspace_bytes(cfg, max_num_batched_tokens)
    cache = usable - weights - workspace
    if cache < 0:
        notes.append(f"the weights ({weights / GIB:,.1f} GiB per GPU) and workspace ({workspace / GIB:,.1f} GiB) "
                     f"exceed the usable memory ({usable / GIB:,.1f} GiB) by {-cache / GIB:,.1f} GiB: "
                     "raise the tensor-parallel size or the memory")
        cache = 0
    rows = cache // layout.row_bytes
    state_rows = 1 + spec_state_rows_per_request
    per_request = math.ceil(max_len / (block_size * dcp)) + state_rows
    concurrent = rows // per_request
    capacity = max(0, rows - concurrent * state_rows) * block_size * dcp
    return CapacityReport(
        bytes_per_token_per_gpu=attention_bytes_per_token(cfg, kv_cache_dtype=kv_cache_dtype,
                                                          index_cache_dtype=index_cache_dtype),
        state_bytes_per_request=kda_state_bytes(cfg, tensor_parallel_size=tp),
        block_size=block_size, row_bytes=layout.row_bytes,
        attention_row_padding=layout.row_bytes - layout.attention_bytes,
        state_row_padding=layout.row_bytes - layout.state_bytes,
        gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=gpu_memory_utilization, usable_bytes=usable,
        weight_bytes_per_gpu=weights, workspace_bytes=workspace, cache_bytes=cache, num_rows=rows,
        max_model_len=max_len, state_rows_per_request=state_rows, rows_per_max_len_request=per_request,
        concurrent_max_len_requests=concurrent, capacity_tokens=capacity, tensor_parallel_size=tp,
        decode_context_parallel_size=dcp, kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
        notes=notes)
