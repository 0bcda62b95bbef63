"""EngineConfig: the engine's options (the server's flags map onto these)."""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024 ** 3
LOAD_FORMATS = ("auto", "safetensors", "dummy")
EXPERT_CACHE_MODES = ("auto", "on", "off")
MM_ENCODER_TP_MODES = ("weights", "data")


@dataclass
class EngineConfig:
    """Engine options (the server's flags map onto these)."""

    model: str
    platform: str | None = None
    dtype: str | None = None                  # None / "auto": the checkpoint's
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1               # DP ranks, each with its own scheduler and cache (k3.engine.distributed)
    enable_expert_parallel: bool = False      # split the routed experts over the ranks (docs/expert-parallel.md)
    expert_parallel_size: int | None = None   # None: the world size; a multiple of TP dividing it (implies EP)
    decode_context_parallel_size: int = 1     # DCP ranks inside each TP group (docs/context-parallel.md)
    # token-sharded prefill (docs/token-sharded-prefill.md): under TP 2, 4 or 8, a fresh prompt chunk
    # of at least this many tokens gets a step of its own and its MLA attention is split over the
    # TP ranks by tokens (pieces r and 15 - r of 16); 0: off
    token_sharded_prefill_min_tokens: int = 0
    distributed_timeout: float = 600.0        # seconds: every collective's timeout (a dead rank is an error after it)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None          # None: the smaller of the config's and the cache's
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    index_cache_dtype: str = "fp8"
    kv_cache_memory_gib: float | None = None  # CPU: cache memory (default: min(2 GiB, RAM / 8))
    gpu_memory_utilization: float = 0.9
    # the expert cache (k3.engine.expert_cache): MXFP4 routed experts dequantised once at load and
    # held dense in the model's dtype, counted by the capacity plan; "auto" holds them so when the
    # cache still fits max_num_seqs max-length requests. None: the platform's default
    # (`k3_config_defaults`, "expert_cache"), else "off"
    expert_cache: str | None = None
    seed: int = 0                             # seeds the draws of requests without a seed
    enable_prefix_caching: bool = False
    prefix_match_unit: int | None = None      # tokens per hashed unit (default: min(64, block))
    kda_checkpoint_interval: int = 0          # extra KDA checkpoints every N tokens (0: prompt ends only)
    speculative_config: str | dict | None = None   # vLLM's --speculative-config JSON
    load_format: str = "auto"                 # "auto" / "safetensors": read the checkpoint; "dummy": random weights
    skip_tokenizer_init: bool = False         # no tokenizer: prompts are token ids, outputs have no text
    enforce_eager: bool = False               # never capture decode graphs
    graph_batch_sizes: tuple[int, ...] | None = None   # capture buckets (default: 1, 2, 4, 8, 16, ...)
    # capture every context bound of every bucket at start-up (runners with table_width_buckets:
    # ppu, tpu), not the wider ones on first use: no capture or XLA compile mid-serving, as vLLM's
    # TPU runner precompiles; start-up pays one capture per (bucket, bound)
    precompile_context_bounds: bool = False
    load_progress: bool = True
    # launch the next decode step before the host has read this one's tokens (overlapping the
    # host's scheduling and output work with the device); tensor parallel size 1, no speculation.
    # None: on where the platform captures decode graphs (the host is then the gap between steps;
    # k3-slice on the H200: +12-13% tokens/s at 64 requests, +2-5% at 16, within the run-to-run
    # spread at 1), off elsewhere
    async_scheduling: bool | None = None
    # prefill/decode disaggregation: vLLM's --kv-transfer-config JSON (k3.engine.kv_transfer.config,
    # docs/disaggregation.md); None: a standalone engine
    kv_transfer_config: str | dict | None = None
    # images (a checkpoint with a vision tower; k3.engine.media): placeholder tokens the encoder may
    # encode in one step (None: max(max_num_batched_tokens, the largest image's tokens)); under
    # tensor parallelism "weights" (vLLM's default) shards the tower's heads and MLP columns over
    # the TP ranks, "data" splits a step's images over them (each has the whole tower) and
    # all-gathers the outputs (k3.vision.tensor_parallel)
    max_num_encoder_tokens: int | None = None
    mm_encoder_tp_mode: str = "weights"
    # vLLM's mm_processor_cache_gb: GiB of preprocessed images (patches) kept by content hash, so
    # an image seen again skips preprocessing (k3.engine.media_cache); 0: off
    mm_processor_cache_gb: float = 4.0
    # vLLM's limit_mm_per_prompt {"image": N}: at most N images a prompt (0: no vision tower is
    # loaded, text only); None: no limit
    limit_mm_per_prompt: dict | None = None
    # fields merged into the checkpoint's config.json before it is read (vLLM's --hf-overrides;
    # k3.config.with_overrides)
    hf_overrides: dict | None = None
    # LoRA adapters (docs/lora.md): --enable-lora, --lora-modules name=path, --max-lora-rank, --max-loras
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None    # adapters loaded at start-up, name -> PEFT folder
    max_lora_rank: int = 16
    max_loras: int = 1                            # adapters resident at once (slots)
    # structured outputs (k3.structured): the grammar backend, and the most seconds one
    # grammar may take to compile (longer: the request is refused)
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_timeout_s: float = 10.0
    # batch-invariant mode (docs/batch-invariance.md; vLLM's VLLM_BATCH_INVARIANT=1): a token's
    # logits bit-identical whatever its batch, chunking or preemption, and in decode or prefill;
    # kernels marked batch invariant only, decode and prefill through the same entries. None:
    # K3_BATCH_INVARIANT=1
    batch_invariant: bool | None = None

    def __post_init__(self):
        if self.batch_invariant is None:
            self.batch_invariant = os.environ.get("K3_BATCH_INVARIANT", "0") not in ("", "0")

    @property
    def max_images_per_prompt(self) -> int | None:
        """limit_mm_per_prompt's image count (None: no limit)."""
        return None if not self.limit_mm_per_prompt else self.limit_mm_per_prompt.get("image")

    def validate(self) -> None:
        """Refuse combinations no part can serve (before anything is loaded)."""
        if self.async_scheduling is True and (self.speculative_config or self.tensor_parallel_size > 1):
            raise ValueError("async_scheduling needs tensor_parallel_size 1 and no speculative decoding (got "
                             f"tensor_parallel_size {self.tensor_parallel_size}, speculative_config "
                             f"{self.speculative_config!r})")
        dcp, tp = self.decode_context_parallel_size, self.tensor_parallel_size
        if dcp < 1 or tp % dcp:
            raise ValueError(f"decode_context_parallel_size {dcp} must divide tensor_parallel_size {tp}")
        if dcp > 1 and (self.speculative_config or self.enable_prefix_caching):
            raise ValueError("decode context parallelism does not run with speculative decoding or prefix caching "
                             "yet (docs/context-parallel.md)")
        if self.token_sharded_prefill_min_tokens:
            self._validate_token_sharded()
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb!r}")
        if self.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be weights or data, got {self.mm_encoder_tp_mode!r}")
        limit = self.limit_mm_per_prompt or {}
        if set(limit) - {"image"} or not all(isinstance(v, int) and v >= 0 for v in limit.values()):
            raise ValueError(f"limit_mm_per_prompt takes {{\"image\": N}} with N >= 0, got {limit!r}")
        if self.max_num_encoder_tokens is not None and self.max_num_encoder_tokens < 1:
            raise ValueError(f"max_num_encoder_tokens must be at least 1, got {self.max_num_encoder_tokens}")
        if self.enable_lora or self.lora_modules:
            self._validate_lora()
        if self.batch_invariant:
            self._validate_batch_invariant()
        if self.expert_cache is not None and self.expert_cache not in EXPERT_CACHE_MODES:
            raise ValueError(f"expert_cache must be auto, on or off, got {self.expert_cache!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.kv_transfer_config is not None:
            from .kv_transfer.config import KVTransferConfig

            KVTransferConfig.parse(self.kv_transfer_config)       # a malformed one fails here, named
            if self.decode_context_parallel_size > 1:
                raise ValueError("kv_transfer_config (prefill/decode disaggregation) does not combine with "
                                 f"decode_context_parallel_size {self.decode_context_parallel_size} yet: a DCP rank's "
                                 "rows hold every DCP-th token (docs/disaggregation.md)")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        for name, value in (("max_lora_rank", self.max_lora_rank), ("max_loras", self.max_loras)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(self.lora_modules or {}) > self.max_loras:
            raise ValueError(f"{len(self.lora_modules)} lora_modules do not fit in max_loras {self.max_loras}")
        others = {"tensor_parallel_size": self.tensor_parallel_size > 1, "data_parallel_size": self.data_parallel_size > 1,
                  "enable_expert_parallel": self.enable_expert_parallel or bool(self.expert_parallel_size),
                  "decode_context_parallel_size": self.decode_context_parallel_size > 1,
                  "speculative_config": bool(self.speculative_config),
                  "kv_transfer_config": self.kv_transfer_config is not None}
        clash = [name for name, on in others.items() if on]
        if clash:
            raise ValueError(f"LoRA adapters run on one rank without speculation or disaggregation for now: "
                             f"enable_lora does not combine with {', '.join(clash)} (docs/lora.md)")


    def _validate_token_sharded(self) -> None:
        n = self.token_sharded_prefill_min_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"token_sharded_prefill_min_tokens must be a non-negative integer, got {n!r}")
        if self.tensor_parallel_size not in (2, 4, 8):
            raise ValueError("token_sharded_prefill_min_tokens splits a prompt over the TP ranks: it needs "
                             f"tensor_parallel_size 2, 4 or 8, got {self.tensor_parallel_size}")
        others = {"decode_context_parallel_size": self.decode_context_parallel_size > 1,
                  "enable_expert_parallel": self.enable_expert_parallel or bool(self.expert_parallel_size),
                  "speculative_config": bool(self.speculative_config), "enable_prefix_caching": self.enable_prefix_caching,
                  "batch_invariant": bool(self.batch_invariant)}
        clash = [name for name, on in others.items() if on]
        if clash:
            raise ValueError("token-sharded prefill does not combine with " + ", ".join(clash) + " yet "
                             "(docs/token-sharded-prefill.md)")

    def _validate_batch_invariant(self) -> None:
        others = {"speculative_config": bool(self.speculative_config),
                  "tensor_parallel_size": self.tensor_parallel_size > 1, "data_parallel_size": self.data_parallel_size > 1,
                  "decode_context_parallel_size": self.decode_context_parallel_size > 1,
                  "enable_expert_parallel": self.enable_expert_parallel or bool(self.expert_parallel_size),
                  "kv_transfer_config": self.kv_transfer_config is not None, "async_scheduling": bool(self.async_scheduling)}
        clash = [name for name, on in others.items() if on]
        if clash:
            raise ValueError(f"batch_invariant runs on one rank without speculation, disaggregation "
                             f"or lookahead for now: it does not combine with {', '.join(clash)} "
                             "(docs/batch-invariance.md)")


def default_cpu_cache_bytes() -> int:
    """The CPU cache's default memory: min(2 GiB, RAM / 8)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 * GIB
    return min(2 * GIB, ram // 8)
