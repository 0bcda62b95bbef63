"""The engine factory: every part of an LLMEngine built ready, in dependency order.

platform -> model and weights -> cache format -> cache plan (every row assigned) -> cache pool
and row allocator (-> prefix cache) -> scheduler -> proposer (speculative decoding) -> runner
(-> decode graphs) -> output processor (detokenisation, stops) -> step strategy (plain,
asynchronous lookahead, or speculative). Each part gets what it needs as arguments; none is
handed the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.cache.block_pool import BlockPool
from k3.cache.capacity import plan_capacity, prefill_token_limit
from k3.cache.format import CacheFormat
from k3.cache.plan import CachePlan, plan_cache
from k3.cache.pool import CachePool
from k3.cache.prefix import PrefixCache
from k3.checkpoint.dummy import load_dummy_weights
from k3.checkpoint.loader import load_checkpoint
from k3.config import K3Config
from k3.dtypes import dtype_name, torch_dtype
from k3.log import get_logger
from k3.platform import select_platform
from k3.structured import StructuredOutputs
from k3.tokenizer import load_tokenizer

from .config import GIB, EngineConfig, default_cpu_cache_bytes
from .expert_cache import ExpertCacheDecision
from .expert_cache import apply as apply_expert_cache
from .lookahead import LookaheadStep
from .outputs import OutputProcessor
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .spec.config import SpeculativeConfig
from .step import PlainStep

logger = get_logger(__name__)


@dataclass
class EngineParts:
    """What an LLMEngine is made of (see the module docstring)."""

    platform: object
    model: object
    tokenizer: object
    plan: CachePlan
    cache: CachePool
    pool: BlockPool
    prefix_cache: PrefixCache | None
    scheduler: Scheduler
    runner: ModelRunner
    outputs: OutputProcessor
    strategy: PlainStep
    async_scheduling: bool
    graph_capture_error: str | None
    kv_producer: object = None          # k3.engine.kv_transfer.producer.KVProducer (disaggregation)
    kv_consumer: object = None          # k3.engine.kv_transfer.consumer.KVConsumer
    media: object = None                # k3.engine.media.MediaEncoder (a checkpoint with a vision tower)
    lora: object = None                 # k3.lora.LoRARegistry (enable_lora)
    expert_cache: ExpertCacheDecision | None = None   # routed MXFP4 experts held dense (k3.engine.expert_cache)


def _sharded_prefill(config: EngineConfig, model, page_size: int):
    """The runner's token-sharded prefill (None without --token-sharded-prefill-min-tokens)."""
    if not config.token_sharded_prefill_min_tokens:
        return None
    from .sharded_prefill import ShardedPrefillStep

    return ShardedPrefillStep(model, min_tokens=config.token_sharded_prefill_min_tokens, page_size=page_size)


def build_engine(config: EngineConfig, *, platform=None, parallel=None, broadcast=None) -> EngineParts:
    """Every part of an engine for `config` (broadcast: the tensor-parallel rank 0's sender)."""
    config.validate()
    platform = platform or select_platform(config.platform, batch_invariant=config.batch_invariant)
    if config.batch_invariant and not getattr(platform, "batch_invariant", False):
        raise ValueError("batch_invariant: the platform given was resolved without batch-invariant kernels "
                         "(select_platform(..., batch_invariant=True))")
    cfg = K3Config.from_pretrained(config.model, config.hf_overrides)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
    model = load_model(config, cfg, platform, parallel)
    device = torch.device(platform.info.device)
    lora = _lora_registry(config, model, device)
    spec = SpeculativeConfig.parse(config.speculative_config)
    tp = model.parallel.world_size
    # decode graphs are captured on one rank without collectives: none under TP, and none under EP
    # (its dispatch sizes the all-to-all on the host, and every rank must replay in lockstep)
    graph_runner = (None if config.enforce_eager or config.batch_invariant or tp > 1 or model.parallel.ep is not None
                    else platform.graph_runner)
    buckets = platform.shape_buckets(config.max_num_seqs, config.max_num_batched_tokens)
    async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                        else graph_runner is not None and spec is None)

    fmt = CacheFormat.build(cfg, activation_dtype=model.dtype, kv_cache_dtype=config.kv_cache_dtype,
                            index_cache_dtype=config.index_cache_dtype, tensor_parallel_size=tp,
                            block_size=config.block_size, platform=platform)
    expert_cache = apply_expert_cache(config, cfg, platform, model,
                                      lambda layers=None: capacity_report(config, cfg, fmt, platform, expert_cache=True,
                                                                          expert_cache_layers=layers))
    budget = cache_bytes(config, cfg, fmt, platform, expert_cache=expert_cache.on, expert_cache_layers=expert_cache.layers)
    if spec is not None and spec.method == "mtp":
        # the MTP layer's own cache comes out of the same budget (as big as the target's token rows)
        from .spec.mtp import target_cache_share

        budget = target_cache_share(budget, cfg, fmt, platform=platform, activation_dtype=model.dtype)
    plan = plan_cache(cfg, fmt, cache_bytes=budget,
                      max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                      num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                      kda_rollback=spec.kda_rollback if spec else "states",
                      graph_scratch=graph_runner is not None or buckets is not None)
    cache = _allocate_cache(platform, cfg, fmt, plan, config)
    if plan.record_slots:
        cache.allocate_records(slots=plan.record_slots, tokens=plan.record_tokens)
    pool = BlockPool(plan.token_rows)
    # under decode context parallelism a row's block_size local positions hold block_size x DCP
    # tokens of the sequence (every DCP-th one on this rank): the scheduler and the metadata count
    # tokens in those logical blocks, so a sequence takes 1 / DCP of the rows (docs/context-parallel.md)
    dcp = model.parallel.context_parallel
    logical_block = plan.block_size * (dcp.size if dcp is not None else 1)
    prefix_cache = _prefix_cache(config, cfg, pool, plan.block_size)
    media = build_media_encoder(config, cfg, model, device)
    encoder_budget = 0
    if media is not None:
        encoder_budget = config.max_num_encoder_tokens or max(config.max_num_batched_tokens,
                                                              media.max_tokens_per_image)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=plan.max_model_len, block_size=logical_block,
        adaptive_token_limit=prefill_token_limit(cfg, config.max_num_batched_tokens, accelerator=device.type != "cpu"),
        checkpoint_interval=config.kda_checkpoint_interval, max_num_encoder_tokens=encoder_budget,
        token_sharded_min_tokens=config.token_sharded_prefill_min_tokens),
        pool, prefix_cache)

    proposer = None
    if spec is not None:
        from .spec.driver import build_proposer

        proposer = build_proposer(spec, target=model, platform=platform, cache_format=fmt,
                                  max_model_len=plan.max_model_len, max_num_seqs=config.max_num_seqs,
                                  model_dir=config.model, token_rows=plan.token_rows)
    graphs, graph_capture_error = None, None
    if graph_runner is not None:
        graphs, graph_capture_error = _decode_graphs(config, platform, model, cache, plan, graph_runner, device,
                                                     buckets)
    padding = None
    if buckets is not None:             # static shapes: every step padded to the platform's buckets
        from .padding import StepPadding

        padding = StepPadding(buckets, plan.graph_scratch_row, logical_block, -(-plan.max_model_len // plan.block_size))
    runner = ModelRunner(model, cache, block_size=logical_block, vocab_size=cfg.vocab_size, device=device,
                         eos_token_ids=cfg.eos_token_ids, tap_layers=proposer.tap_layers if proposer else (),
                         graphs=graphs, pinned_uploads=async_scheduling and _pins_for(device), broadcast=broadcast,
                         batch_invariant=config.batch_invariant, media=media,
                         sharded_prefill=_sharded_prefill(config, model, logical_block), padding=padding,
                         step_end=platform.step_end)
    outputs = OutputProcessor(scheduler, tokenizer, eos_token_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size,
                              max_model_len=plan.max_model_len, seed=config.seed,
                              release=proposer.release if proposer else None, media=media,
                              structured=StructuredOutputs(tokenizer, cfg.vocab_size, cfg.eos_token_ids,
                                                           backend=config.structured_outputs_backend,
                                                           compile_timeout_s=config.structured_outputs_timeout_s))
    if spec is not None:
        from .spec.driver import SpeculativeStep

        scratch = BlockPool(len(plan.spec_rows), first_row=plan.spec_rows.start) if plan.spec_rows else None
        strategy = SpeculativeStep(scheduler, runner, outputs, config=spec, proposer=proposer, scratch=scratch,
                                   max_model_len=plan.max_model_len)
    elif async_scheduling:
        strategy = LookaheadStep(scheduler, runner, outputs, max_model_len=plan.max_model_len)
    else:
        strategy = PlainStep(scheduler, runner, outputs)
    kv_producer, kv_consumer = _kv_transfer(config, cache, pool, prefix_cache, scheduler)
    if lora is not None:     # a slot is reused only when no live request still runs on it
        lora._in_use = lambda: {r.lora_slot for r in outputs.requests.values() if not r.finished}
    return EngineParts(platform=platform, model=model, tokenizer=tokenizer, plan=plan, cache=cache, pool=pool,
                       prefix_cache=prefix_cache, scheduler=scheduler, runner=runner, outputs=outputs,
                       strategy=strategy, async_scheduling=async_scheduling, graph_capture_error=graph_capture_error,
                       kv_producer=kv_producer, kv_consumer=kv_consumer, media=media, lora=lora,
                       expert_cache=expert_cache)


def _pins_for(device: torch.device) -> bool:
    """Page-locked staging helps uploads to torch's accelerator (CUDA, HIP...); a device torch
    pins nothing for (the CPU, an XLA device) uploads from pageable memory."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return device.type != "cpu" and accelerator is not None and accelerator.type == device.type


def build_media_encoder(config: EngineConfig, cfg: K3Config, model, device):
    """The MediaEncoder of a checkpoint whose config has a vision_config (None otherwise, or with
    limit_mm_per_prompt {"image": 0}): the tower read from the shards (random with load_format
    "dummy"), in the model's dtype on its device. A checkpoint whose config declares a tower its
    shards do not hold at all serves text only (with a notice)."""
    vision = cfg.extra_top.get("vision_config")
    if not vision or cfg.media_placeholder_token_id is None or config.max_images_per_prompt == 0:
        return None
    from k3.vision import MoonViTConfig, MoonViTTower, init_vision_params
    from k3.vision.weights import has_vision_tensors, load_vision_tower

    from .media import IN_PATCH_LIMIT, PATCH_LIMIT_ON_ONE_SIDE, MediaEncoder

    if config.load_format == "dummy":
        vcfg = MoonViTConfig.from_dict(vision)
        tower = MoonViTTower(vcfg, init_vision_params(vcfg, seed=config.seed, dtype=model.dtype))
    elif not has_vision_tensors(config.model):
        logger.warning(f"{config.model}: the config declares a vision tower but the checkpoint holds none of its "
                       "tensors; serving text only")
        return None
    else:
        tower = load_vision_tower(config.model, dtype=model.dtype)
    tower.p = {name: t.to(device) for name, t in tower.p.items()}
    encoder = MediaEncoder(tower, cfg.media_placeholder_token_id, dtype=model.dtype, device=device,
                           in_patch_limit=int(vision.get("in_patch_limit", IN_PATCH_LIMIT)),
                           patch_limit_on_one_side=int(vision.get("patch_limit_on_one_side", PATCH_LIMIT_ON_ONE_SIDE)),
                           cache_bytes=int(config.mm_processor_cache_gb * GIB))
    encoder.max_images = config.max_images_per_prompt
    return encoder


def _lora_registry(config: EngineConfig, model, device):
    """The LoRA registry over `max_loras` slots of the model (None without enable_lora), the
    start-up adapters (`lora_modules`) loaded. Adapters are held in the model's dtype."""
    if not config.enable_lora:
        return None
    from k3.lora import LoRARegistry
    from k3.model.lora import attach_lora

    state = attach_lora(model, max_loras=config.max_loras, max_rank=config.max_lora_rank, dtype=model.dtype,
                        device=device)
    registry = LoRARegistry(state)
    for name, path in (config.lora_modules or {}).items():
        registry.load(name, path)
    return registry


def _kv_transfer(config: EngineConfig, cache: CachePool, pool: BlockPool, prefix_cache, scheduler: Scheduler):
    """(producer, consumer) of prefill/decode disaggregation ((None, None) without a kv_transfer_config):
    one backend serves both roles of a kv_both engine."""
    from .kv_transfer.config import KVTransferConfig

    kv = KVTransferConfig.parse(config.kv_transfer_config)
    if kv is None:
        return None, None
    from .kv_transfer.backend import make_backend
    from .kv_transfer.consumer import KVConsumer
    from .kv_transfer.producer import KVProducer

    backend = make_backend(kv)
    producer = KVProducer(kv, backend, cache, pool) if kv.is_producer else None
    consumer = None
    if kv.is_consumer:
        consumer = KVConsumer(kv, backend, cache, pool, prefix_cache, registered=producer.base if producer else None)
    scheduler.kv_producer, scheduler.kv_consumer = producer, consumer
    return producer, consumer


def load_model(config: EngineConfig, cfg: K3Config, platform, parallel):
    """The platform's model for this rank with its weights loaded (or random ones: load_format
    "dummy"), processed by the platform and folded."""
    dtype = torch_dtype(cfg.dtype if config.dtype in (None, "auto") else config.dtype)
    model = platform.build_model(cfg, dtype=dtype, parallel=parallel)
    if config.load_format == "dummy":
        load_dummy_weights(model, seed=config.seed, progress=config.load_progress)
    else:
        # the tower, when the engine serves images, loads through k3.vision (build_media_encoder)
        load_checkpoint(model, config.model, progress=config.load_progress,
                        vision_notice=config.max_images_per_prompt == 0)
    platform.process_weights(model)
    model.model.fold_weights()
    return model


def _allocate_cache(platform, cfg: K3Config, fmt: CacheFormat, plan, config: EngineConfig) -> CachePool:
    """The cache pool, or a ValueError that says why the device could not hold it (typically
    another process on the same device: the plan counts the whole device's memory)."""
    try:
        return CachePool.on_platform(platform, cfg, fmt, plan.num_rows)
    except torch.OutOfMemoryError:
        device = torch.device(platform.info.device)
        wanted = plan.num_rows * fmt.layout(cfg).row_bytes / GIB
        free = ""
        module = torch.get_device_module(device) if device.type != "cpu" else None
        if module is not None and hasattr(module, "mem_get_info"):
            free_bytes, total_bytes = module.mem_get_info(device)
            free = f" ({free_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB free)"
        raise ValueError(f"the KV cache ({plan.num_rows} rows, {wanted:.2f} GiB) does not fit on {device}{free}: "
                         f"another process may hold memory there; lower --gpu-memory-utilization (now "
                         f"{config.gpu_memory_utilization:g}) or free the device") from None


def capacity_report(config: EngineConfig, cfg: K3Config, fmt: CacheFormat, platform, *, expert_cache: bool = False,
                    expert_cache_layers: int | None = None):
    """The capacity plan of this engine on the platform's device memory (`plan_capacity`);
    expert_cache: the routed MXFP4 experts counted dense (`k3.engine.expert_cache`), those of the
    first expert_cache_layers MoE layers (None: all)."""
    return plan_capacity(cfg, kv_cache_dtype=fmt.kv_cache_dtype, index_cache_dtype=fmt.index_cache_dtype,
                         tensor_parallel_size=fmt.tensor_parallel_size,
                         gpu_memory_bytes=platform.capabilities.memory_bytes,
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         max_num_batched_tokens=config.max_num_batched_tokens, block_size=fmt.block_size,
                         max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                         activation_dtype=dtype_name(fmt.activation_dtype), alignment=fmt.alignment,
                         suggest=False, expert_cache=expert_cache, expert_cache_layers=expert_cache_layers)


def cache_bytes(config: EngineConfig, cfg: K3Config, fmt: CacheFormat, platform, *, expert_cache: bool = False,
                expert_cache_layers: int | None = None) -> int:
    """The cache's memory: on the CPU, or a device that reports no memory size (PJRT's CPU device
    under XLA), kv_cache_memory_gib (default min(2 GiB, RAM / 8)); on an accelerator what the
    capacity plan leaves after the weights (the routed experts dense with `expert_cache`) and
    the workspace."""
    if torch.device(platform.info.device).type == "cpu" or not platform.capabilities.memory_bytes:
        return int(config.kv_cache_memory_gib * GIB) if config.kv_cache_memory_gib else default_cpu_cache_bytes()
    return capacity_report(config, cfg, fmt, platform, expert_cache=expert_cache,
                           expert_cache_layers=expert_cache_layers).cache_bytes


def _prefix_cache(config: EngineConfig, cfg: K3Config, pool: BlockPool, block: int) -> PrefixCache | None:
    if not config.enable_prefix_caching:
        return None
    unit = config.prefix_match_unit or min(64, block)
    if config.kda_checkpoint_interval % unit:
        raise ValueError(f"kda_checkpoint_interval ({config.kda_checkpoint_interval}) must be a multiple "
                         f"of the prefix-match unit ({unit})")
    return PrefixCache(pool, block_size=block, unit=unit, needs_checkpoints=bool(cfg.kda_layer_ids))


def _decode_graphs(config: EngineConfig, platform, model, cache: CachePool, plan: CachePlan, graph_runner, device,
                   shape_buckets=None):
    """(DecodeGraphs, None), or (None, the error) when the platform cannot capture (a capture
    that fails must not stop serving). The buckets: --graph-batch-sizes, else the platform's
    static batch buckets (`k3_shape_buckets`), else vLLM's sizes."""
    from .graphs import DecodeGraphs, default_buckets

    buckets = config.graph_batch_sizes or (shape_buckets.batch if shape_buckets is not None
                                           else default_buckets(config.max_num_seqs))
    try:
        return DecodeGraphs(model, cache.views, graph_runner, buckets=buckets, scratch_row=plan.graph_scratch_row,
                            block_size=plan.block_size, max_pages=-(-plan.max_model_len // plan.block_size),
                            device=device, progress=config.load_progress,
                            precompile_bounds=config.precompile_context_bounds), None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        logger.warning(f"decode graph capture failed on platform {platform.name} ({error}); "
                       "decoding eagerly (--enforce-eager skips the attempt)")
        return None, error
