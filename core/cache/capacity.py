"""Capacity of the packed cache for a memory budget: every term of the sum, stated.

usable = HBM per GPU x gpu_memory_utilization
cache  = usable - weights per GPU (from the config and its quantisation, exact per rank)
                - workspace (fixed 2 GiB + the prefill activations of the largest forward
                  the scheduler may run: max(max_num_batched_tokens, the adaptive limit of a
                  lone request), the AttnRes block bank included)
rows   = cache // row_bytes
         - speculative scratch rows (rollback "states": max_num_seqs x (1 + k), reserved
           at start-up in a pool of their own)
A max-length request needs ceil(max_len / (block x DCP)) attention rows plus its one state
row, so concurrent = rows // that; the token capacity is what the attention rows left after
those state rows hold, times DCP (each DCP rank stores every DCP-th token). Prefix caching
reserves nothing: its KDA checkpoints take rows from the token capacity and are evicted
least-recently-used with the blocks they belong to.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from k3.config import K3Config
from k3.dtypes import torch_dtype

from .format import CacheFormat
from .plan import default_block_size, plan_cache
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
    speculative_scratch_rows: int    # reserved at start-up (rollback "states"), not usable for tokens
    prefix_checkpoint_rows_per_chunk: int   # taken from the token capacity while a chunk prefills
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
    """Exact bytes of rank 0's parameters and buffers once loaded (W4A16 experts dense, their
    packed planes freed), plus the weights the engine folds from them at load
    (`K3Model.fold_weights`: MLA's absorbed decode weights, AttnRes logit weights); meta
    device: nothing is allocated."""
    from k3.model import K3ForCausalLM, ParallelContext

    model = K3ForCausalLM(cfg, parallel=ParallelContext(rank=0, world_size=tensor_parallel_size),
                          dtype=torch_dtype(cfg.dtype), device="meta")
    # W4A16 experts: the packed planes are freed once dequantised at load (`MoE.dequantize_int4_experts`)
    freed = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if cfg.experts_int4 else ()
    tensors = list(model.parameters()) + [b for name, b in model.named_buffers() if not name.endswith(freed)]
    return sum(t.numel() * t.element_size() for t in tensors) + model.model.folded_weight_bytes()


# Activations one forward may hold while a lone request prefills with a larger chunk than
# max_num_batched_tokens (the scheduler's adaptive budget).
ACTIVATION_BUDGET = {"cpu": 1 * GIB, "accelerator": 4 * GIB}


def activation_bytes_per_token(cfg: K3Config) -> int:
    """Prefill activations per token in flight, the largest layer's at once: the AttnRes block
    bank plus a few hidden-sized bf16 temporaries, plus the biggest of
      - a routed-expert layer: per (token, choice) one bf16 activation row of the expert width
        and one fp32 output row of the expert hidden width (k3-slice: 320 KiB a token);
      - a KDA layer's chunked recurrence: about ten fp32 per-position tensors of heads x head
        dim, and the fp32 state of each 64-token chunk (K3: 480 KiB a token);
      - an MLA layer's prefill: every head's keys, values and queries in bf16.
    Counting only the first term let a lone 32K-token prefill on k3-slice run out of memory
    on the H200 (the lone-request chunk grew to 21K tokens); with all of them the chunk stays
    at max_num_batched_tokens there."""
    bank = cfg.hidden_size * 2 * (cfg.num_attn_res_blocks + 6)
    moe = (cfg.num_experts_per_token or 0) * ((cfg.moe_intermediate_size or 0) * 2 + cfg.expert_hidden_size * 4)
    kda = 0
    if cfg.linear_attn is not None:
        heads, dim = cfg.linear_attn.num_heads, cfg.linear_attn.head_dim
        kda = heads * dim * 4 * 10 + heads * dim * dim * 4 // 64
    mla = cfg.num_attention_heads * (2 * cfg.mla_qk_head_dim + (cfg.v_head_dim or 0)) * 2
    return bank + max(moe, kda, mla)


def prefill_token_limit(cfg: K3Config, max_num_batched_tokens: int, *, accelerator: bool) -> int:
    """Tokens one forward may take: max_num_batched_tokens, or more when the activation
    budget allows it (used for a lone request's prefill)."""
    budget = ACTIVATION_BUDGET["accelerator" if accelerator else "cpu"]
    return max(max_num_batched_tokens, budget // activation_bytes_per_token(cfg))


def workspace_bytes(cfg: K3Config, max_num_batched_tokens: int, *, accelerator: bool = True) -> int:
    """Fixed workspace plus the activations of the largest forward the scheduler may run."""
    tokens = prefill_token_limit(cfg, max_num_batched_tokens, accelerator=accelerator)
    return FIXED_WORKSPACE + tokens * activation_bytes_per_token(cfg)


def plan_capacity(cfg: K3Config, *, kv_cache_dtype: str = "bf16", index_cache_dtype: str = "fp8",
                  tensor_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                  gpu_memory_bytes: int = int(DEFAULT_GPU_MEMORY_GIB * GIB), gpu_memory_utilization: float = 0.9,
                  max_model_len: int | None = None, block_size: int | None = None,
                  max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, num_speculative_tokens: int = 0,
                  kda_rollback: str = "states", prefix_caching: bool = False, kda_checkpoint_interval: int = 0,
                  activation_dtype: str | None = None, alignment: int = 256) -> CapacityReport:
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ValueError(f"decode context parallel size {dcp} must divide tensor parallel size {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    max_len = max_model_len or cfg.max_position_embeddings
    if block_size is None:
        block_size = default_block_size(cfg, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype,
                                        index_cache_dtype=index_cache_dtype)
    fmt = CacheFormat(activation_dtype=torch_dtype(activation_dtype or cfg.dtype), kv_cache_dtype=kv_cache_dtype,
                      index_cache_dtype=index_cache_dtype, tensor_parallel_size=tp, block_size=block_size,
                      alignment=alignment)
    layout = fmt.layout(cfg)
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
    chunk = prefill_token_limit(cfg, max_num_batched_tokens, accelerator=True) if prefix_caching else 0
    plan = plan_cache(cfg, fmt, cache_bytes=cache, max_num_seqs=max_num_seqs,
                      num_speculative_tokens=num_speculative_tokens, kda_rollback=kda_rollback,
                      prefix_chunk_tokens=chunk, kda_checkpoint_interval=kda_checkpoint_interval, strict=False)
    rows, scratch = plan.num_rows, len(plan.spec_rows)
    if scratch and rows and scratch >= rows:
        notes.append(f"the {scratch:,} speculative scratch rows (max_num_seqs {max_num_seqs} x (1 + "
                     f"{num_speculative_tokens})) take every one of the {rows:,} rows: the server would refuse to start")
    token_rows = max(0, rows - scratch)
    state_rows = 1
    per_request = math.ceil(max_len / (block_size * dcp)) + state_rows
    concurrent = token_rows // per_request
    capacity = max(0, token_rows - concurrent * state_rows) * block_size * dcp
    checkpoint_rows = plan.prefix_checkpoint_rows_per_chunk
    if checkpoint_rows:
        notes.append(f"prefix caching reserves nothing: each cached KDA checkpoint takes one row from the token "
                     f"capacity (evicted least-recently-used); a prefill chunk of up to {chunk:,} tokens takes "
                     f"up to {checkpoint_rows:,} such rows as it runs")
    return CapacityReport(
        bytes_per_token_per_gpu=attention_bytes_per_token(cfg, kv_cache_dtype=kv_cache_dtype,
                                                          index_cache_dtype=index_cache_dtype),
        state_bytes_per_request=kda_state_bytes(cfg, tensor_parallel_size=tp),
        block_size=block_size, row_bytes=layout.row_bytes,
        attention_row_padding=layout.row_bytes - layout.attention_bytes,
        state_row_padding=layout.row_bytes - layout.state_bytes,
        gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=gpu_memory_utilization, usable_bytes=usable,
        weight_bytes_per_gpu=weights, workspace_bytes=workspace, cache_bytes=cache, num_rows=rows,
        speculative_scratch_rows=scratch, prefix_checkpoint_rows_per_chunk=checkpoint_rows,
        max_model_len=max_len, state_rows_per_request=state_rows, rows_per_max_len_request=per_request,
        concurrent_max_len_requests=concurrent, capacity_tokens=capacity, tensor_parallel_size=tp,
        decode_context_parallel_size=dcp, kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
        notes=notes)
