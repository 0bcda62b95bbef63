"""Prometheus metrics (`GET /metrics`, text format): k3's `k3:` families and vLLM's `vllm:`
ones (`k3.serve.vllm_metrics`, for vLLM's dashboards), both always.

Per-request figures (finish reasons, TTFT, TPOT, end-to-end latency) are observed by the
server; engine-wide figures (token counters, running / waiting requests, cache rows,
preemptions) are read from `AsyncEngine.stats()` at scrape time. Each app has its own
registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        s = self.engine.stats()
        yield CounterMetricFamily("k3:prompt_tokens", "prompt tokens admitted", value=s["prompt_tokens_total"])
        yield CounterMetricFamily("k3:generation_tokens", "tokens generated", value=s["generation_tokens_total"])
        yield CounterMetricFamily("k3:num_preemptions", "requests preempted (recomputed later)",
                                  value=s["preemptions_total"])
        yield GaugeMetricFamily("k3:num_requests_running", "requests in the running batch", value=s["running"])
        yield GaugeMetricFamily("k3:num_requests_waiting", "requests waiting to be scheduled", value=s["waiting"])
        used = s["cache_rows"] - s["cache_rows_free"]
        yield GaugeMetricFamily("k3:cache_rows_used", "cache rows in use", value=used)
        yield GaugeMetricFamily("k3:cache_rows_total", "cache rows in the pool", value=s["cache_rows"])
        yield GaugeMetricFamily("k3:cache_usage_perc", "fraction of cache rows in use (0 to 1)",
                                value=used / s["cache_rows"] if s["cache_rows"] else 0.0)
        yield CounterMetricFamily("k3:prefix_cache_queries", "prefix-cache lookups (requests)",
                                  value=s.get("prefix_cache_queries_total", 0))
        yield CounterMetricFamily("k3:prefix_cache_hits", "prefix-cache lookups that reused tokens",
                                  value=s.get("prefix_cache_hits_total", 0))
        yield CounterMetricFamily("k3:prefix_cache_reused_tokens", "prompt tokens taken from the prefix cache",
                                  value=s.get("prefix_cache_reused_tokens_total", 0))
        yield GaugeMetricFamily("k3:prefix_cache_rows", "rows held by the prefix cache (pages, KDA checkpoints)",
                                value=s.get("prefix_cache_rows", 0) + s.get("prefix_cache_checkpoint_rows", 0))
        yield GaugeMetricFamily("k3:prefix_cache_checkpoint_bytes", "bytes of the KDA checkpoint rows",
                                value=s.get("prefix_cache_checkpoint_bytes", 0))
        yield CounterMetricFamily("k3:spec_decode_verify_steps", "speculative verify steps",
                                  value=s.get("spec_verify_steps_total", 0))
        yield CounterMetricFamily("k3:spec_decode_num_draft_tokens", "drafted tokens",
                                  value=s.get("spec_draft_tokens_total", 0))
        yield CounterMetricFamily("k3:spec_decode_num_accepted_tokens", "accepted drafted tokens",
                                  value=s.get("spec_accepted_tokens_total", 0))
        yield GaugeMetricFamily("k3:spec_decode_mean_acceptance_length",
                                "tokens per verify step (accepted drafts + 1)",
                                value=s.get("spec_mean_acceptance_length", 0.0))
        if "mm_images_total" in s:          # a model with a vision tower (k3.engine.media)
            yield CounterMetricFamily("k3:mm_images", "images received in prompts", value=s["mm_images_total"])
            yield CounterMetricFamily("k3:mm_encoder_runs", "vision encoder runs (one packed tower call a step)",
                                      value=s["mm_encoder_runs_total"])
            yield CounterMetricFamily("k3:mm_encoder_tokens", "image tokens the vision encoder produced (images "
                                      "the prefix cache covered are not encoded)", value=s["mm_encoder_tokens_total"])
            yield CounterMetricFamily("k3:mm_cache_queries", "preprocessed-image cache lookups (images)",
                                      value=s["mm_cache_queries_total"])
            yield CounterMetricFamily("k3:mm_cache_hits", "images whose preprocessing came from the cache",
                                      value=s["mm_cache_hits_total"])
        per_position = GaugeMetricFamily("k3:spec_decode_acceptance_rate_per_position",
                                         "acceptance rate of draft position i", labels=["position"])
        for i, rate in enumerate(s.get("spec_acceptance_per_position", [])):
            per_position.add_metric([str(i)], rate)
        yield per_position


class Metrics:
    """The server's registry and per-request instruments (k3's and vLLM's).

    model_name: the `model_name` label of the vLLM families (the first served name); cache_info:
    the labels of `vllm:cache_config_info`."""

    def __init__(self, engine, *, model_name: str = "k3", cache_info: dict[str, str] | None = None):
        disable_created_metrics()  # no `*_created` series (process-wide, as in vLLM)
        self.registry = CollectorRegistry()
        self.requests = Counter("k3:request_success", "finished choices by finish reason", ["finished_reason"],
                                registry=self.registry)
        self.ttft = Histogram("k3:time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("k3:time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("k3:e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))
        self.vllm = VllmMetrics(self.registry, engine, model_name=model_name, max_model_len=_max_model_len(engine),
                                cache_info=cache_info)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _max_model_len(engine) -> int:
    inner = getattr(engine, "engine", None)
    return int(getattr(inner, "max_model_len", 0) or 0) or 1 << 20


class _Choice:
    """One choice's tokens seen so far and when its first and latest tokens arrived."""

    __slots__ = ("tokens", "first", "last")

    def __init__(self):
        self.tokens, self.first, self.last = 0, None, None


class RequestTimer:
    """Times one API request (all its prompts and choices) for the histograms.

    params: the request's SamplingParams (its n and max_tokens feed vLLM's request_params_*)."""

    def __init__(self, metrics: Metrics, params=None):
        self.metrics, self.params = metrics, params
        self.start = time.monotonic()
        self.first: float | None = None
        self.tokens = 0
        self.done = False
        self._choices: dict[tuple[int, int], _Choice] = {}
        self._finals: dict = {}                      # prompt index -> its latest RequestOutput

    def saw(self, output, index: int = 0) -> None:
        """An output of prompt `index` arrived (cumulative, as the engine streams them): first
        tokens and inter-token gaps are observed now (tokens that arrive together share the gap
        since the previous arrival)."""
        now = time.monotonic()
        self._finals[index] = output
        v = self.metrics.vllm
        for c in output.outputs:
            n = len(c.token_ids)
            st = self._choices.setdefault((index, c.index), _Choice())
            new = n - st.tokens
            if new <= 0:
                continue
            if st.tokens == 0:
                st.first = base = now
                v.ttft.observe(now - self.start)
                new -= 1
            else:
                base = st.last
            gap = (now - base) / new if new else 0.0
            for _ in range(new):
                v.itl.observe(gap)
                v.tpot.observe(gap)
            st.tokens, st.last = n, now
        longest = max((len(c.token_ids) for c in output.outputs), default=0)
        if longest and self.first is None:
            self.first = now
        self.tokens = max(self.tokens, longest)

    def finish(self, reasons: list[str | None]) -> None:
        """Record the request once (idempotent); a missing reason counts as an abort. `reasons`
        has one entry per choice of every prompt (the API's reasons, for k3:request_success;
        vLLM's request_success takes the engine's)."""
        if self.done:
            return
        self.done = True
        end = time.monotonic()
        for reason in reasons:
            self.metrics.requests.labels(finished_reason=reason or "abort").inc()
        self.metrics.e2e.observe(end - self.start)
        if self.first is not None:
            self.metrics.ttft.observe(self.first - self.start)
            if self.tokens > 1:
                self.metrics.tpot.observe((end - self.first) / (self.tokens - 1))
        self._finish_vllm(end, len(reasons))

    def _finish_vllm(self, end: float, num_choices: int) -> None:
        v, seen = self.metrics.vllm, 0
        max_tokens = getattr(self.params, "max_tokens", None)
        for index, out in self._finals.items():
            scheduled = out.metrics.get("first_scheduled_time")
            arrival = out.metrics.get("arrival_time", self.start)
            longest = 0
            for c in out.outputs:
                seen += 1
                st = self._choices.get((index, c.index), _Choice())
                n = len(c.token_ids)
                longest = max(longest, n)
                v.finished(c.finish_reason).inc()
                v.e2e.observe(end - self.start)
                v.queue.observe(max(0.0, (scheduled if scheduled is not None else end) - arrival))
                if scheduled is not None:
                    v.inference.observe(max(0.0, (st.last or end) - scheduled))
                    v.prefill.observe(max(0.0, (st.first or end) - scheduled))
                else:
                    v.inference.observe(0.0)
                    v.prefill.observe(0.0)
                decode = (st.last - st.first) if st.first is not None else 0.0
                v.decode.observe(decode)
                v.request_tpot.observe(decode / (n - 1) if n > 1 else 0.0)
                v.prompt_tokens.observe(len(out.prompt_token_ids))
                v.generation_tokens.observe(n)
                if max_tokens:
                    v.params_max_tokens.observe(max_tokens)
            v.max_generation_tokens.observe(longest)
            v.params_n.observe(len(out.outputs))
        for _ in range(max(0, num_choices - seen)):     # prompts that never produced an output
            v.finished(None).inc()


router = APIRouter()


@router.get("/metrics", include_in_schema=True, response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this server."""
    return Response(request.app.state.k3.metrics.render(), media_type=CONTENT_TYPE_LATEST)
