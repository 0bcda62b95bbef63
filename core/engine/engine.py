"""LLMEngine: requests in, tokens and text out, one scheduled step at a time.

It holds the parts the factory built (`k3.engine.factory`): the platform's model (one rank,
or rank 0 driving tensor-parallel workers), the packed cache and its plan, the scheduler, the
runner, the output processor and the step strategy that drives them.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .config import EngineConfig, default_cpu_cache_bytes
from .factory import build_engine
from .params import SamplingParams
from .request import Request, RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "default_cpu_cache_bytes"]


class LLMEngine:
    """platform, parallel: a platform and tensor-parallel context chosen by the caller (the
    tensor-parallel driver); broadcast: rank 0's sender of each step to the other ranks;
    on_shutdown: called by `shutdown` (the tensor-parallel driver stops its workers)."""

    def __init__(self, config: EngineConfig, *, platform=None, parallel=None, broadcast=None, on_shutdown=None):
        parts = build_engine(config, platform=platform, parallel=parallel, broadcast=broadcast)
        self.config, self.platform, self.model, self.tokenizer = config, parts.platform, parts.model, parts.tokenizer
        self.model_config = self.model.cfg
        self.device = torch.device(self.platform.info.device)
        self.plan, self.cache, self.pool, self.prefix_cache = parts.plan, parts.cache, parts.pool, parts.prefix_cache
        self.max_model_len = self.plan.max_model_len
        self.scheduler, self.runner, self.outputs = parts.scheduler, parts.runner, parts.outputs
        self.structured = parts.outputs.structured      # compile cache of structured outputs (k3.structured)
        self.strategy = parts.strategy
        self.async_scheduling, self.graph_capture_error = parts.async_scheduling, parts.graph_capture_error
        self.kv_producer, self.kv_consumer = parts.kv_producer, parts.kv_consumer
        self.media = parts.media
        self.lora = parts.lora                  # k3.lora.LoRARegistry, None without enable_lora
        self.expert_cache = parts.expert_cache  # k3.engine.expert_cache.ExpertCacheDecision
        self._on_shutdown = on_shutdown

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    multi_modal_data: dict | None = None) -> None:
        """Queue a request; `prompt` is text (encoded with special tokens as text) or token ids.

        multi_modal_data: vLLM's {"image": image or list} for a prompt with one media placeholder
        token per image (`k3.engine.media`; ValueError for a model without a vision tower).

        Disaggregation (docs/disaggregation.md): on a producer, params.kv_transfer_params
        {"do_remote_decode": true} runs the prefill and first token only (max_tokens 1) and the
        final output's kv_transfer_params is the handle; on a consumer, a handle pulls the
        prompt's rows and decodes on (a failed pull prefills here)."""
        params = params or SamplingParams()
        if multi_modal_data and self.runner.batch_invariant:
            raise ValueError("images are not supported in the batch-invariant mode (the vision tower is not "
                             "built from batch-invariant kernels yet; docs/batch-invariance.md)")
        lora = {}
        if params.lora_name is not None:
            if self.lora is None:
                from k3.lora import LoRANotFound

                raise LoRANotFound(f"The model `{params.lora_name}` does not exist (LoRA is not enabled).")
            adapter = self.lora.get(params.lora_name)
            lora = {"lora_slot": adapter.slot, "cache_salt": adapter.salt}
        kv = params.kv_transfer_params
        if self.kv_producer is not None and kv and kv.get("do_remote_decode") and params.n == 1:
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.outputs.add(request_id, prompt, params, multi_modal_data, **lora)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(self, name: str, path: str):
        """Load the PEFT adapter at `path` as `name` (k3.lora.LoRARegistry.load; LoRAError when
        refused). Call between steps (the async engine's engine thread: `AsyncEngine.call`)."""
        return self._registry().load(name, path)

    def unload_lora_adapter(self, name: str):
        """Forget adapter `name` (LoRANotFound when it is not loaded); running requests finish on it."""
        return self._registry().unload(name)

    def lora_adapters(self) -> list:
        """The loaded adapters (k3.lora.LoadedAdapter), in load order; [] without LoRA."""
        return [] if self.lora is None else list(self.lora.adapters.values())

    def _registry(self):
        if self.lora is None:
            from k3.lora import LoRAError

            raise LoRAError("LoRA is not enabled (start the engine with enable_lora / --enable-lora)")
        return self.lora

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (or every child of an n > 1 request); its rows are free at once."""
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self.strategy.in_flight
                or (self.kv_consumer is not None and self.kv_consumer.busy)
                or (self.kv_producer is not None and self.kv_producer.due()))

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns the outputs of every request that progressed.

        With async_scheduling the forward whose outputs are returned may have been launched by
        the previous call, and this call launches the next decode step before reading them.
        Disaggregation: first frees confirmed pins (producer) and admits arrived transfers
        (consumer), whose first token is among the outputs."""
        if self.kv_producer is not None:
            self.kv_producer.poll()
        arrived = []
        if self.kv_consumer is not None:
            if not self.scheduler.has_unfinished() and not self.strategy.in_flight:
                self.kv_consumer.idle_wait(0.01)        # only pulls in flight: wait for one, do not spin
            arrived = self._admit_transfers()
        return arrived + self.strategy.step()

    def _admit_transfers(self) -> list[RequestOutput]:
        """Requests whose rows arrived: append the producer's first token and queue them for
        decode; failed transfers are queued for local prefill."""
        admitted, fallback = self.kv_consumer.poll()
        self.scheduler.waiting.extend(fallback)
        touched: set[str] = set()
        now = time.monotonic()
        for request in admitted:
            kv = request.params.kv_transfer_params
            top = kv.get("first_top") or ([], []) if request.params.logprobs else None
            self.outputs.append(request, int(kv["first_token"]), float(kv["first_logprob"]), top, now)
            if not request.finished:
                self.scheduler.waiting.append(request)
            touched.add(request.request_id)
        return self.outputs.collect(touched)

    def shutdown(self) -> None:
        if self.kv_consumer is not None:
            self.kv_consumer.close()
        kv = self.kv_producer or self.kv_consumer
        if kv is not None:
            kv.backend.close()
        if self._on_shutdown is not None:
            self._on_shutdown()

    # ------------------------------------------------------------------ state and counters
    @property
    def requests(self) -> dict[str, Request]:
        """The requests in the engine, by (child) request id."""
        return self.outputs.requests

    @property
    def stats(self) -> dict:
        """Requests and tokens since start-up."""
        return self.outputs.stats

    def snapshot(self) -> dict:
        """Counters and load in one dict (what the server's /metrics and the DP front-end's
        balancing read): requests and tokens, running / waiting, preemptions, cache rows and free
        rows, prefix caching, speculation."""
        return {**self.stats, "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "preemptions_total": self.scheduler.num_preemptions, "cache_rows": self.pool.num_rows,
                "cache_rows_free": self.pool.num_free, "iteration_tokens": self.scheduler.step_tokens.to_dict(),
                **self.prefix_cache_stats(), **self.spec_stats(),
                **self.kv_transfer_stats(), **(self.media.stats if self.media is not None else {})}

    def kv_transfer_stats(self) -> dict:
        """Disaggregation counters ({} without a kv_transfer_config): pins and pulls."""
        out = {}
        if self.kv_producer is not None:
            out.update({f"kv_{k}_total": v for k, v in self.kv_producer.stats.items()},
                       kv_pinned_rows=self.kv_producer.num_pinned_rows)
        if self.kv_consumer is not None:
            out.update({f"kv_{k}_total": v for k, v in self.kv_consumer.stats.items()})
        return out

    @property
    def num_lookahead_steps(self) -> int:
        """Decode steps launched before the previous step's tokens were read (async_scheduling)."""
        return self.strategy.num_lookahead_steps

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters (zeros when it is off) and the rows its checkpoints hold."""
        cache = self.prefix_cache
        if cache is None:
            return {"prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0,
                    "prefix_cache_queried_tokens_total": 0, "prefix_cache_reused_tokens_total": 0, "prefix_cache_checkpoint_rows": 0,
                    "prefix_cache_checkpoint_bytes": 0, "prefix_cache_rows": 0, "prefix_cache_evictable_rows": 0}
        return {"prefix_cache_queries_total": cache.stats.queries, "prefix_cache_hits_total": cache.stats.hits,
                "prefix_cache_queried_tokens_total": cache.stats.queried_tokens,
                "prefix_cache_reused_tokens_total": cache.stats.reused_tokens,
                "prefix_cache_checkpoint_rows": cache.num_checkpoint_rows,
                "prefix_cache_checkpoint_bytes": cache.num_checkpoint_rows * self.plan.layout.row_bytes,
                "prefix_cache_rows": cache.num_cached_rows, "prefix_cache_evictable_rows": cache.num_evictable_rows}

    def spec_stats(self) -> dict:
        """Speculative decoding's counters ({} without speculation)."""
        return self.strategy.spec_stats()
