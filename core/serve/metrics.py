"""Prometheus metrics (`GET /metrics`, text format), every name prefixed `k3:`.

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
        per_position = GaugeMetricFamily("k3:spec_decode_acceptance_rate_per_position",
                                         "acceptance rate of draft position i", labels=["position"])
        for i, rate in enumerate(s.get("spec_acceptance_per_position", [])):
            per_position.add_metric([str(i)], rate)
        yield per_position


class Metrics:
    """The server's registry and per-request instruments."""

    def __init__(self, engine):
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one API request (all its prompts and choices) for the histograms."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.start = time.monotonic()
        self.first: float | None = None
        self.tokens = 0
        self.done = False

    def saw(self, num_tokens: int) -> None:
        """An output arrived; `num_tokens` is the longest choice so far."""
        if num_tokens and self.first is None:
            self.first = time.monotonic()
        self.tokens = max(self.tokens, num_tokens)

    def finish(self, reasons: list[str | None]) -> None:
        """Record the request once (idempotent); a missing reason counts as an abort."""
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


router = APIRouter()


@router.get("/metrics", include_in_schema=True, response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    """Prometheus metrics of this server."""
    return Response(request.app.state.k3.metrics.render(), media_type=CONTENT_TYPE_LATEST)
