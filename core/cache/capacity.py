"""Capacity of the packed cache for a memory budget: every term of the sum, stated.

usable = HBM per GPU x gpu_memory_utilization
cache  = usable - weights per GPU (from the config and its quantisation, exact per rank;
                  `WeightTerms`: attention, routed experts, shared experts / dense,
                  embedding + lm_head, other; with the expert cache the routed MXFP4 experts
                  count as the dense stacks `MoE.hold_experts_dense` holds, their planes freed)
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

Distributed topologies (`k3.cache.topology`): TP shards the attention, dense and shared
experts, embedding and lm_head; the routed experts are split over TP, or over EP with expert
parallelism; DP replicates everything else. Each DP rank is an engine with its own cache:
`capacity_tokens` is one engine's, `capacity_tokens_total` all DP ranks'. The plan fits
(`FITS_CRITERION`) when weights + workspace fit the usable memory and the cache holds at least
one max-length request; when it does not, `smallest_fitting_topology` searches the smallest
topology that does with the same memory per GPU and max-model-len.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from k3.config import K3Config
from k3.dtypes import torch_dtype

from .format import CacheFormat
from .plan import default_block_size, plan_cache
from .records import attention_bytes_per_token, kda_state_bytes
from .topology import DEFAULT_GPU_MEMORY_GIB, DEFAULT_GPUS_PER_NODE, Topology, candidate_topologies  # noqa: F401

GIB = 1024 ** 3
FIXED_WORKSPACE = 2 * GIB
FITS_CRITERION = ("weights + workspace <= usable memory (HBM x gpu_memory_utilization) and the cache holds "
                  "at least one max-length request (concurrent_max_len_requests >= 1)")


@dataclass(frozen=True)
class WeightTerms:
    """One GPU's weights once loaded, by part (bytes; they add up to `total`).

    attention:         KDA and MLA mixers (the DSA indexer included) and MLA's absorbed decode
                       weights folded at load; sharded over TP (latent / index-key projections
                       replicated, as the model holds them)
    routed_experts:    experts_per_rank routed experts (MXFP4 planes and their scales, or the
                       dense stacks of the expert cache)
    shared_dense:      the shared experts and the dense layers' MLPs; sharded over TP
    embedding_lm_head: the embedding and lm_head, vocabulary-sharded over TP
    other:             the router (fp32 gate, correction bias), the LatentMoE down / up
                       projections and norm, every RMSNorm, AttnRes weights and the AttnRes
                       logit weights folded at load; replicated
    """

    attention: int
    routed_experts: int
    shared_dense: int
    embedding_lm_head: int
    other: int
    experts_per_rank: int
    expert_layers: int = 0           # MoE layers holding routed experts
    dense_expert_layers: int = 0     # of them, held dense by the expert cache (the first ones)

    @property
    def total(self) -> int:
        return self.attention + self.routed_experts + self.shared_dense + self.embedding_lm_head + self.other

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


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
    # distributed topology (k3.cache.topology); the fields above are one GPU's / one engine's
    data_parallel_size: int = 1
    expert_parallel_size: int | None = None        # None: expert parallelism off
    nnodes: int = 1
    gpus_per_node: int = 1
    world_size: int = 1
    weight_terms: WeightTerms | None = None        # weight_bytes_per_gpu by part
    capacity_tokens_total: int = 0                 # capacity_tokens x data_parallel_size (one cache per DP rank)
    fits: bool = False                             # FITS_CRITERION
    fits_criterion: str = FITS_CRITERION
    suggested: dict | None = None                  # when it does not fit: the smallest fitting topology
    expert_cache: bool = False                     # routed MXFP4 experts counted dense (the expert cache)
    expert_cache_layers: int = 0                   # MoE layers whose experts it holds (all or the first ones)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["weight_terms"] = self.weight_terms.to_dict() if self.weight_terms else None
        return out

    @property
    def topology(self) -> Topology:
        return Topology(tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
                        expert_parallel_size=self.expert_parallel_size, nnodes=self.nnodes,
                        gpus_per_node=self.gpus_per_node)


def weight_bytes_per_gpu(cfg: K3Config, tensor_parallel_size: int, expert_parallel_size: int | None = None, *,
                         expert_cache_dtype: torch.dtype | None = None, expert_cache_layers: int | None = None) -> int:
    """Exact bytes of one GPU's parameters and buffers once loaded (W4A16 experts dense, their
    packed planes freed), plus the weights the engine folds from them at load
    (`K3Model.fold_weights`: MLA's absorbed decode weights, AttnRes logit weights); the sum of
    `weight_terms_per_gpu`. expert_parallel_size: None, the experts split over TP.
    expert_cache_dtype: MXFP4 routed experts held dense in this dtype (the expert cache), in the
    first expert_cache_layers MoE layers (None: all)."""
    return weight_terms_per_gpu(cfg, tensor_parallel_size, expert_parallel_size, expert_cache_dtype=expert_cache_dtype,
                                expert_cache_layers=expert_cache_layers).total


_ROUTED = ("w13", "w13_packed", "w13_scale", "w2", "w2_packed", "w2_scale")
_TP_TERMS: dict[tuple[str, int], tuple[dict[str, int], int]] = {}


def _term_of(name: str) -> str:
    """The WeightTerms part of a parameter / buffer of K3ForCausalLM."""
    if name.startswith(("lm_head", "model.embed_tokens")):
        return "embedding_lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".shared_experts." in name or ".mlp." in name:
        return "shared_dense"
    if ".block_sparse_moe." in name and name.rsplit(".", 1)[-1] in _ROUTED:
        return "routed_experts"
    return "other"


def _tp_rank_terms(cfg: K3Config, tensor_parallel_size: int) -> tuple[dict[str, int], int, int]:
    """(bytes by part, routed experts held a layer, layers holding routed experts) of TP rank 0
    as the model builds it, on the meta device (nothing is allocated); memoised, the topology
    search asks for few TP sizes."""
    import json

    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), tensor_parallel_size)
    if key not in _TP_TERMS:
        from k3.model import K3ForCausalLM, ParallelContext

        model = K3ForCausalLM(cfg, parallel=ParallelContext(rank=0, world_size=tensor_parallel_size),
                              dtype=torch_dtype(cfg.dtype), device="meta")
        # W4A16 experts: the packed planes are freed once dequantised at load (`MoE.dequantize_int4_experts`)
        freed = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if cfg.experts_int4 else ()
        terms = dict.fromkeys(("attention", "routed_experts", "shared_dense", "embedding_lm_head", "other"), 0)
        named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if not n.endswith(freed)]
        for name, t in named:
            terms[_term_of(name)] += t.numel() * t.element_size()
        # folded at load: MLA's absorbed w_uk / w_uv (as many elements as kv_b_proj), the rest AttnRes
        absorbed = sum(t.numel() * t.element_size() for n, t in named if n.endswith("self_attn.kv_b_proj"))
        terms["attention"] += absorbed
        terms["other"] += model.model.folded_weight_bytes() - absorbed
        held = cfg.num_experts // tensor_parallel_size if cfg.num_experts else 0
        stack = ".block_sparse_moe.w2" + ("_packed" if cfg.experts_mxfp4 else "")      # one a routed-expert layer
        layers = sum(name.endswith(stack) for name, _ in named)
        _TP_TERMS[key] = (terms, held, layers)
    terms, held, layers = _TP_TERMS[key]
    return dict(terms), held, layers


def weight_terms_per_gpu(cfg: K3Config, tensor_parallel_size: int, expert_parallel_size: int | None = None, *,
                         expert_cache_dtype: torch.dtype | None = None,
                         expert_cache_layers: int | None = None) -> WeightTerms:
    """One GPU's weights by part (see WeightTerms): everything but the routed experts as TP
    rank 0 holds it (every TP rank holds the same bytes), the routed experts num_experts / TP
    of them without expert parallelism, num_experts / EP with it (every expert the same size).
    expert_cache_dtype: MXFP4 experts held dense in this dtype (`MoE.hold_experts_dense`), 3 I L
    elements each, instead of their planes; in the first expert_cache_layers MoE layers (None:
    every one; the partial cache of a device too small for all of them)."""
    topology = Topology(tensor_parallel_size=tensor_parallel_size, data_parallel_size=1,
                        expert_parallel_size=expert_parallel_size)
    per_rank = topology.experts_per_rank(cfg.num_experts)
    terms, held, layers = _tp_rank_terms(cfg, tensor_parallel_size)
    dense_layers = 0
    if held and layers:
        per_expert, rest = divmod(terms["routed_experts"], held)       # one expert of every MoE layer
        assert not rest and not per_expert % layers, "routed experts of unequal sizes"
        if expert_cache_dtype is not None and cfg.experts_mxfp4:
            dense_layers = layers if expert_cache_layers is None else max(0, min(expert_cache_layers, layers))
            dense = 3 * cfg.moe_intermediate_size * cfg.expert_hidden_size * expert_cache_dtype.itemsize
            per_expert = dense_layers * dense + (layers - dense_layers) * (per_expert // layers)
        terms["routed_experts"] = per_expert * per_rank
    return WeightTerms(**terms, experts_per_rank=per_rank, expert_layers=layers if held else 0,
                       dense_expert_layers=dense_layers)


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


def request_capacity(token_rows: int, max_model_len: int, logical_block: int) -> tuple[int, int]:
    """(max-length requests the token rows hold at once, tokens they hold): a request takes
    ceil(max_model_len / logical_block) attention rows and one state row; the token capacity is
    what the attention rows left after those state rows hold. logical_block: the block size
    times the DCP size (each DCP rank stores every DCP-th token)."""
    per_request = math.ceil(max_model_len / logical_block) + 1
    concurrent = token_rows // per_request
    return concurrent, max(0, token_rows - concurrent) * logical_block


def plan_capacity(cfg: K3Config, *, kv_cache_dtype: str = "bf16", index_cache_dtype: str = "fp8",
                  tensor_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                  data_parallel_size: int = 1, expert_parallel_size: int | None = None,
                  nnodes: int | None = None, gpus_per_node: int | None = None, suggest: bool = True,
                  gpu_memory_bytes: int = int(DEFAULT_GPU_MEMORY_GIB * GIB), gpu_memory_utilization: float = 0.9,
                  max_model_len: int | None = None, block_size: int | None = None,
                  max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, num_speculative_tokens: int = 0,
                  kda_rollback: str = "states", prefix_caching: bool = False, kda_checkpoint_interval: int = 0,
                  activation_dtype: str | None = None, alignment: int = 256,
                  expert_cache: bool = False, expert_cache_layers: int | None = None) -> CapacityReport:
    """One GPU's and one engine's cache capacity under a topology (module docstring: every
    term). expert_parallel_size: None, off (experts split over TP); it must divide TP x DP.
    expert_cache: the routed MXFP4 experts held dense in the activation dtype (the expert
    cache, `k3.engine.expert_cache`), their planes freed; in the first expert_cache_layers MoE
    layers (None: every one).
    suggest: when the plan does not fit, search the smallest topology that does
    (`smallest_fitting_topology`, same memory per GPU, max-model-len and cache settings)."""
    tp, dcp = tensor_parallel_size, decode_context_parallel_size
    topology = Topology.build(tp, data_parallel_size, expert_parallel_size=expert_parallel_size, nnodes=nnodes,
                              gpus_per_node=gpus_per_node)
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ValueError(f"decode context parallel size {dcp} must divide tensor parallel size {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    max_len = max_model_len or cfg.max_position_embeddings
    block_size_arg = block_size
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
    cache_dtype = torch_dtype(activation_dtype or cfg.dtype) if expert_cache else None
    terms = weight_terms_per_gpu(cfg, tp, topology.expert_parallel_size, expert_cache_dtype=cache_dtype,
                                 expert_cache_layers=expert_cache_layers)
    weights = terms.total
    workspace = workspace_bytes(cfg, max_num_batched_tokens)
    cache = usable - weights - workspace
    weights_fit = cache >= 0
    if cache < 0:
        notes.append(f"the weights ({weights / GIB:,.1f} GiB per GPU) and workspace ({workspace / GIB:,.1f} GiB) "
                     f"exceed the usable memory ({usable / GIB:,.1f} GiB) by {-cache / GIB:,.1f} GiB: "
                     "raise the tensor-parallel size, enable expert parallelism over more GPUs, or raise the memory")
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
    concurrent, capacity = request_capacity(token_rows, max_len, block_size * dcp)
    checkpoint_rows = plan.prefix_checkpoint_rows_per_chunk
    if checkpoint_rows:
        notes.append(f"prefix caching reserves nothing: each cached KDA checkpoint takes one row from the token "
                     f"capacity (evicted least-recently-used); a prefill chunk of up to {chunk:,} tokens takes "
                     f"up to {checkpoint_rows:,} such rows as it runs")
    fits = weights_fit and concurrent >= 1
    suggested = None
    if not fits and suggest:
        found = smallest_fitting_topology(
            cfg, gpus_per_node=topology.gpus_per_node if gpus_per_node is not None else DEFAULT_GPUS_PER_NODE,
            kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
            decode_context_parallel_size=dcp, gpu_memory_bytes=gpu_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_len, block_size=block_size_arg,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            num_speculative_tokens=num_speculative_tokens, kda_rollback=kda_rollback, prefix_caching=prefix_caching,
            kda_checkpoint_interval=kda_checkpoint_interval, activation_dtype=activation_dtype, alignment=alignment,
            expert_cache=expert_cache, expert_cache_layers=expert_cache_layers)
        suggested = found.to_dict() if found else None
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
        notes=notes, data_parallel_size=topology.data_parallel_size,
        expert_parallel_size=topology.expert_parallel_size, nnodes=topology.nnodes,
        gpus_per_node=topology.gpus_per_node, world_size=topology.world_size, weight_terms=terms,
        capacity_tokens_total=capacity * topology.data_parallel_size, fits=fits, suggested=suggested,
        expert_cache=terms.dense_expert_layers > 0, expert_cache_layers=terms.dense_expert_layers)


# The search stops here: no K3-architecture model needs more (K3 fits on 16 H200s).
MAX_SUGGESTED_GPUS = 1024


def smallest_fitting_topology(cfg: K3Config, *, gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
                              max_gpus: int = MAX_SUGGESTED_GPUS, **plan_kwargs) -> Topology | None:
    """The first topology of `candidate_topologies` (fewest GPUs, then more EP, then fewer TP;
    TP in 1, 2, 4, 8 within a node) whose plan fits with `plan_kwargs` (memory per GPU,
    max-model-len, cache settings: everything but the topology); None when none up to
    `max_gpus` does. Candidates the model cannot split (heads, vocabulary, experts; a DCP size
    that does not divide TP) are skipped."""
    for topology in candidate_topologies(gpus_per_node=gpus_per_node, max_gpus=max_gpus):
        try:
            report = plan_capacity(cfg, tensor_parallel_size=topology.tensor_parallel_size,
                                   data_parallel_size=topology.data_parallel_size,
                                   expert_parallel_size=topology.expert_parallel_size, nnodes=topology.nnodes,
                                   gpus_per_node=topology.gpus_per_node, suggest=False, **plan_kwargs)
        except ValueError:
            continue
        if report.fits:
            return topology
    return None
