"""LLMEngine: requests in, tokens and text out, one scheduled step at a time.

It owns the platform's model (one rank, or rank 0 driving tensor-parallel workers), the
packed cache pool, the scheduler and the per-request output state (detokenizer, stop strings).
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from k3.cache.block_pool import BlockPool
from k3.cache.capacity import plan_capacity, prefill_token_limit, speculative_scratch_rows
from k3.cache.plan import default_block_size, row_layout
from k3.cache.pool import CachePool
from k3.cache.prefix import PrefixCache
from k3.checkpoint.dummy import load_dummy_weights
from k3.checkpoint.loader import load_checkpoint
from k3.config import K3Config
from k3.engine.stop import StopStringMatcher
from k3.platform import select_platform
from k3.tokenizer import IncrementalDetokenizer, load_tokenizer
from k3.tokenizer.detokenize import NoDetokenizer

from .lookahead import Launched, lookahead_decodes
from .output import build_output
from .params import SamplingParams
from .prompt_logprobs import append_prompt_logprobs
from .request import Request, RequestOutput
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .spec.config import SpeculativeConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
_LATENT_AUTO = {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
GIB = 1024 ** 3


@dataclass
class EngineConfig:
    """Engine options (the server's flags map onto these)."""

    model: str
    platform: str | None = None
    dtype: str | None = None                  # None / "auto": the checkpoint's
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None          # None: the smaller of the config's and the cache's
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    index_cache_dtype: str = "fp8"
    kv_cache_memory_gib: float | None = None  # CPU: cache memory (default: min(2 GiB, RAM / 8))
    gpu_memory_utilization: float = 0.9
    seed: int = 0                             # seeds the draws of requests without a seed
    enable_prefix_caching: bool = False
    prefix_match_unit: int | None = None      # tokens per hashed unit (default: min(64, block))
    kda_checkpoint_interval: int = 0          # extra KDA checkpoints every N tokens (0: prompt ends only)
    speculative_config: str | dict | None = None   # vLLM's --speculative-config JSON
    load_format: str = "auto"                 # "auto" / "safetensors": read the checkpoint; "dummy": random weights
    skip_tokenizer_init: bool = False         # no tokenizer: prompts are token ids, outputs have no text
    enforce_eager: bool = False               # never capture decode graphs
    graph_batch_sizes: tuple[int, ...] | None = None   # capture buckets (default: 1, 2, 4, 8, 16, ...)
    load_progress: bool = True
    # launch the next decode step before the host has read this one's tokens (overlapping the
    # host's scheduling and output work with the device); tensor parallel size 1, no speculation.
    # None: on where the platform captures decode graphs (the host is then the gap between steps;
    # k3-slice on the H200: +12-13% tokens/s at 64 requests, +2-5% at 16, within the run-to-run
    # spread at 1), off elsewhere
    async_scheduling: bool | None = None


def default_cpu_cache_bytes() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 * GIB
    return min(2 * GIB, ram // 8)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, platform=None, parallel=None):
        self.config = config
        if config.async_scheduling is True and (config.speculative_config or config.tensor_parallel_size > 1):
            raise ValueError("async_scheduling needs tensor_parallel_size 1 and no speculative decoding (got "
                             f"tensor_parallel_size {config.tensor_parallel_size}, speculative_config "
                             f"{config.speculative_config!r})")
        self.platform = platform or select_platform(config.platform)
        self.model_config = cfg = K3Config.from_pretrained(config.model)
        if config.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {config.load_format!r}")
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        dtype = _DTYPES[cfg.dtype if config.dtype in (None, "auto") else config.dtype]
        self.device = torch.device(self.platform.info.device)
        self.model = self.platform.build_model(cfg, dtype=dtype, parallel=parallel)
        if config.load_format == "dummy":
            load_dummy_weights(self.model, seed=config.seed, progress=config.load_progress)
        else:
            load_checkpoint(self.model, config.model, progress=config.load_progress)
        self.platform.process_weights(self.model)
        self.model.model.fold_weights()
        tp = self.model.parallel.world_size
        self.kv_cache_dtype = _LATENT_AUTO[dtype] if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        act = self.activation_dtype = {v: k for k, v in _DTYPES.items()}[dtype]
        block = config.block_size or default_block_size(cfg, tensor_parallel_size=tp, kv_cache_dtype=self.kv_cache_dtype,
                                                        index_cache_dtype=config.index_cache_dtype, activation_dtype=act)
        self.layout = row_layout(cfg, block_size=block, tensor_parallel_size=tp, kv_cache_dtype=self.kv_cache_dtype,
                                 index_cache_dtype=config.index_cache_dtype, activation_dtype=act,
                                 alignment=self.platform.cache_alignment)
        num_rows = self._cache_bytes(cfg, tp) // self.layout.row_bytes
        self.cache = CachePool.on_platform(self.platform, cfg, self.layout, num_rows, activation_dtype=act,
                                           kv_cache_dtype=self.kv_cache_dtype,
                                           index_cache_dtype=config.index_cache_dtype, tensor_parallel_size=tp)
        spec = SpeculativeConfig.parse(config.speculative_config)
        # speculative "states" rollback: 1 + k scratch rows per running request, planned up front
        reserved = 0
        if spec is not None:
            reserved = speculative_scratch_rows(cfg, max_num_seqs=config.max_num_seqs,
                                                num_speculative_tokens=spec.num_speculative_tokens,
                                                kda_rollback=spec.kda_rollback)
            if reserved and reserved >= num_rows:
                raise ValueError(f"the cache holds {num_rows} rows, too few for the {reserved} speculative scratch "
                                 f"rows of max_num_seqs {config.max_num_seqs} x (1 + {spec.num_speculative_tokens}): "
                                 "give it more memory, lower max_num_seqs, or use kda_rollback \"recover\"")
        # decode graphs (when the platform captures): one scratch row for the padding sequences
        graph_runner = None if config.enforce_eager or tp > 1 else self.platform.graph_runner
        scratch = 1 if graph_runner is not None else 0
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else graph_runner is not None and spec is None)
        self.pool = BlockPool(num_rows - reserved - scratch)
        self.spec_pool = BlockPool(reserved, first_row=num_rows - reserved) if reserved else None
        self.graph_scratch_row = num_rows - reserved - 1 if scratch else None
        self.graph_capture_error: str | None = None
        num_rows -= reserved + scratch
        cache_len = (num_rows - 1) * block
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings,
                                 cache_len)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            unit = config.prefix_match_unit or min(64, block)
            if config.kda_checkpoint_interval % unit:
                raise ValueError(f"kda_checkpoint_interval ({config.kda_checkpoint_interval}) must be a multiple "
                                 f"of the prefix-match unit ({unit})")
            self.prefix_cache = PrefixCache(self.pool, block_size=block, unit=unit,
                                            needs_checkpoints=bool(cfg.kda_layer_ids))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=block,
            adaptive_token_limit=self._adaptive_token_limit(cfg),
            checkpoint_interval=config.kda_checkpoint_interval), self.pool, self.prefix_cache)
        self.runner = ModelRunner(self.model, self.cache, block_size=block, vocab_size=cfg.vocab_size,
                                  device=self.device)
        if graph_runner is not None:
            from .graphs import DecodeGraphs, default_buckets

            buckets = config.graph_batch_sizes or default_buckets(config.max_num_seqs)
            try:
                self.runner.graphs = DecodeGraphs(self.model, self.cache.views, graph_runner, buckets=buckets,
                                                  scratch_row=self.graph_scratch_row, block_size=block,
                                                  max_pages=-(-self.max_model_len // block), device=self.device,
                                                  progress=config.load_progress)
            except Exception as e:     # a capture the platform cannot do must not stop serving
                self.graph_capture_error = f"{type(e).__name__}: {e}"
                print(f"k3: decode graph capture failed on platform {self.platform.name} ({self.graph_capture_error}); "
                      "decoding eagerly (--enforce-eager skips the attempt)", file=sys.stderr)
        self.stop_token_ids = set(cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}           # parent id -> child request ids (n > 1)
        self.parent_of: dict[str, str] = {}
        self.prompts: dict[str, str | None] = {}
        self._streams: dict[str, tuple[IncrementalDetokenizer, StopStringMatcher, list[str]]] = {}
        self._rng = random.Random(config.seed)
        self.broadcast = None                             # set by the tensor-parallel driver
        self.stats = {"requests_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0}
        self.speculation = None
        if spec is not None:
            from .spec.driver import Speculation

            self.speculation = Speculation(spec, self)
        # asynchronous scheduling: the launched step whose tokens the host has not read yet
        self._pending: Launched | None = None
        self.num_lookahead_steps = 0
        self.runner.pinned_uploads = self.async_scheduling and self.device.type != "cpu"

    # ------------------------------------------------------------------ sizing
    def _cache_bytes(self, cfg: K3Config, tp: int) -> int:
        c = self.config
        if self.device.type == "cpu":
            return int(c.kv_cache_memory_gib * GIB) if c.kv_cache_memory_gib else default_cpu_cache_bytes()
        report = plan_capacity(cfg, kv_cache_dtype=self.kv_cache_dtype, index_cache_dtype=c.index_cache_dtype,
                               tensor_parallel_size=tp, gpu_memory_bytes=self.platform.capabilities.memory_bytes,
                               gpu_memory_utilization=c.gpu_memory_utilization,
                               max_num_batched_tokens=c.max_num_batched_tokens, block_size=self.layout.block_size,
                               activation_dtype=self.activation_dtype, alignment=self.platform.cache_alignment)
        return report.cache_bytes

    def _adaptive_token_limit(self, cfg: K3Config) -> int:
        """Tokens one forward may take in flight (a lone request's prefill chunk): the
        activation budget the capacity plan's workspace reserves."""
        return prefill_token_limit(cfg, self.config.max_num_batched_tokens, accelerator=self.device.type != "cpu")

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; `prompt` is text (encoded with special tokens as text) or token ids."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError("the engine runs without a tokenizer (skip_tokenizer_init): pass the prompt as token ids "
                             "and stop with stop_token_ids, not stop strings")
        ids = self.tokenizer.encode(prompt, allow_special=False) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary (size {self.model_config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context is {self.max_model_len} "
                             "tokens (prompt + output)")
        children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for i, child in enumerate(children):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(62)
            request = Request(child, ids, params, seed)
            if params.prompt_logprobs is not None:
                request.prompt_logprobs.append(None)        # the first prompt token has none
            self.scheduler.add(request)
            self.requests[child] = request
            self.parent_of[child] = request_id
            detok = (NoDetokenizer() if self.tokenizer is None
                     else IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens))
            self._streams[child] = (detok, StopStringMatcher(params.stop), [])
        self.groups[request_id] = children
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.stats["requests_total"] += 1
        self.stats["prompt_tokens_total"] += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (or every child of an n > 1 request); its rows are free at once."""
        for child in self.groups.pop(request_id, []):
            self.parent_of.pop(child, None)
            request = self.requests.pop(child, None)
            if request is not None and not request.finished:
                self.scheduler.finish(request, "abort")
            if request is not None and self.speculation is not None:
                self.speculation.release(request)
            self._streams.pop(child, None)
        self.prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters (zeros when it is off) and the rows its checkpoints hold."""
        cache = self.prefix_cache
        if cache is None:
            return {"prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0,
                    "prefix_cache_reused_tokens_total": 0, "prefix_cache_checkpoint_rows": 0,
                    "prefix_cache_checkpoint_bytes": 0, "prefix_cache_rows": 0}
        return {"prefix_cache_queries_total": cache.stats.queries, "prefix_cache_hits_total": cache.stats.hits,
                "prefix_cache_reused_tokens_total": cache.stats.reused_tokens,
                "prefix_cache_checkpoint_rows": cache.num_checkpoint_rows,
                "prefix_cache_checkpoint_bytes": cache.num_checkpoint_rows * self.layout.row_bytes,
                "prefix_cache_rows": cache.num_cached_rows}

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the outputs of every request that progressed.

        With async_scheduling the forward whose outputs are returned may have been launched by
        the previous call, and this call launches the next decode step before reading them."""
        if self.async_scheduling:
            return self._step_async()
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        if self.speculation is not None:
            self.speculation.prepare(out)
        rows, samples, spec_logits, prompt = self.runner.run(out, self._not_yet(out), broadcast=self.broadcast)
        self._append_prompt_logprobs(out, prompt)
        starts = [s.request.num_computed_tokens for s in out.scheduled]
        verified = self.speculation.accept(out, spec_logits) if self.speculation is not None else {}
        self.scheduler.commit(out, self.speculation.kept if verified else None)
        if self.runner.taps is not None:        # a DSpark draft reads the committed tokens' features
            for i, s in enumerate(out.scheduled):
                kept = s.request.num_computed_tokens - starts[i]
                first = self.runner.token_starts[i]
                self.speculation.observe(s.request, starts[i], self.runner.taps[first:first + kept])
        touched = set()
        now = time.monotonic()
        for request_id, (tokens, logprobs) in verified.items():
            request = self.requests[request_id]
            for token, logprob in zip(tokens, logprobs):
                if request.finished:
                    break
                self._append(request, token, logprob, None, now)
            touched.add(request_id)
        if samples is not None:
            self._append_samples(out, rows, samples, now, touched)
        return self._outputs(touched)

    def _append_prompt_logprobs(self, out: SchedulerOutput, prompt) -> None:
        """Read a step's scored prompt positions (waiting for the device) into its requests."""
        if prompt is None:
            return
        tok = self.tokenizer
        decode = (lambda t: None) if tok is None else (lambda t: tok.decode([t]))
        append_prompt_logprobs(prompt, [s.request for s in out.scheduled], decode)

    def _not_yet(self, out: SchedulerOutput) -> list[set[int]]:
        """Per scheduled request, the token ids it must not sample yet (min_tokens)."""
        return [self.stop_token_ids if s.request.params.min_tokens > s.output_index else set() for s in out.scheduled]

    def _append_samples(self, out: SchedulerOutput, rows: list[int], samples, now: float, touched: set) -> None:
        """Read a step's sampled tokens (waiting for the device) and append them to their
        requests (rows of `out.scheduled`); a request that finished or was aborted since the
        launch (asynchronous scheduling) gets nothing. Adds the ids appended to `touched`."""
        tokens, logprobs = samples.tokens.tolist(), samples.logprobs.tolist()
        tops = None if samples.top_ids is None else list(zip(samples.top_ids.tolist(), samples.top_logprobs.tolist()))
        for j, row in enumerate(rows):
            request = out.scheduled[row].request
            if request.finished:
                continue
            self._append(request, tokens[j], logprobs[j], None if tops is None else tops[j], now)
            touched.add(request.request_id)

    def _outputs(self, touched: set) -> list[RequestOutput]:
        parents = dict.fromkeys(self.parent_of[child] for child in touched)
        return [self._output(p) for p in parents]

    def _step_async(self) -> list[RequestOutput]:
        """One step of asynchronous scheduling (vLLM's async scheduling, for decodes):
          1. the step to finish: the one launched last time, else a normally scheduled one,
             launched and committed now (its input tokens are on the host);
          2. the next step launched at once when it can be a plain continuation, its decodes'
             input tokens copied on the device from (1)'s samples (`lookahead_decodes`);
          3. (1)'s tokens read (the only wait for the device, now with (2) queued behind it),
             appended and checked for stops; then (2) is committed, its input tokens now known.
        A request that stopped in (1) wastes its slot in (2), whose token for it is dropped."""
        launched = self._pending
        if launched is None:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            launched = self._launch(out)
            self.scheduler.commit(out)
        following = lookahead_decodes(self, launched)
        if following is not None:
            self.num_lookahead_steps += 1
        outputs = self._collect(launched)
        if following is not None:
            self.scheduler.commit(SchedulerOutput(scheduled=[s for s in following.out.scheduled
                                                             if not s.request.finished]))
        self._pending = following
        return outputs

    def _launch(self, out: SchedulerOutput, previous_tokens=None) -> Launched:
        """Run a scheduled step on the device without waiting for it."""
        rows, samples, _, prompt = self.runner.run(out, self._not_yet(out), previous_tokens=previous_tokens)
        return Launched(out, rows, samples, prompt)

    def _collect(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and append them (`_append_samples`)."""
        self._append_prompt_logprobs(launched.out, launched.prompt_logprobs)
        if launched.samples is None:
            return []
        touched: set[str] = set()
        self._append_samples(launched.out, launched.rows, launched.samples, time.monotonic(), touched)
        return self._outputs(touched)

    def apply_kda_commit(self, *, row_copies=(), records=None) -> None:
        """Commit verified KDA states on every rank (row copies, or a record rebuild)."""
        if row_copies:
            self.runner.apply_row_copies(list(row_copies))
        if records is not None:
            self.model.commit_speculation(self.cache.views, *records)

    def spec_stats(self) -> dict:
        return {} if self.speculation is None else self.speculation.stats.to_dict()

    def _append(self, request: Request, token: int, logprob: float, top, now: float) -> None:
        request.output_token_ids.append(token)
        request.output_logprobs.append(logprob)
        if request.params.logprobs:
            ids, lps = top
            request.output_top_logprobs.append(list(zip(ids, lps))[: request.params.logprobs])
        request.first_token_time = request.first_token_time or now
        self.stats["generation_tokens_total"] += 1
        detok, stops, pieces = self._streams[request.request_id]
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.stop_token_ids):
            request.stop_reason = token
            pieces.append(stops.push(detok.finish()) + stops.flush())
            self.scheduler.finish(request, "stop")
            return
        text = stops.push(detok.step([token]))
        if stops.stopped is not None:
            pieces.append(text + (stops.stopped if params.include_stop_str_in_output else ""))
            request.stop_reason = stops.stopped
            self.scheduler.finish(request, "stop")
            return
        pieces.append(text)
        at_limit = params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens
        if at_limit or request.num_tokens >= self.max_model_len:
            pieces.append(stops.push(detok.finish()) + stops.flush())
            self.scheduler.finish(request, "length")

    def _output(self, parent: str) -> RequestOutput:
        children = [self.requests[c] for c in self.groups[parent]]
        result = build_output(parent, self.prompts[parent], children, [self._streams[c][2] for c in self.groups[parent]])
        if result.finished:
            for c in self.groups.pop(parent):
                request = self.requests.pop(c, None)
                if request is not None and self.speculation is not None:
                    self.speculation.release(request)
                self._streams.pop(c, None)
                self.parent_of.pop(c, None)
            self.prompts.pop(parent, None)
        return result
