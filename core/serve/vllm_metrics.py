"""vLLM's Prometheus families (`vllm:` names, `model_name` and `engine` labels) beside k3's own.

A stock vLLM Grafana dashboard (vLLM's examples/observability) queries these names with
`{model_name="$model_name"}`; `k3 serve` exports them always, next to the `k3:` families, so a
dashboard works unchanged and nothing else has to be configured (docs/serving.md, "Metrics").
They follow vLLM V1's meanings, which differ from some `k3:` ones: the prefix-cache counters
count tokens (k3's count lookups), a request is one engine request (one choice of one prompt;
k3 counts finished choices too), `time_per_output_token_seconds` is the deprecated alias of
`inter_token_latency_seconds` (one observation per token after the first; k3's is a mean per
API request). `vllm:mm_cache_*` count images looked up in and found in the preprocessed-image
cache (`--mm-processor-cache-gb`), as vLLM's processor cache counts items.

`VllmMetrics` owns the per-request histograms (observed by `k3.serve.metrics.RequestTimer`);
its collector renders the engine-wide figures from `AsyncEngine.stats()` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM V1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")      # vLLM's FinishReason values
LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def vllm_cache_usage(stats: dict) -> float:
    """vLLM's KV-cache usage from an engine's stats: rows neither free nor held by the prefix
    cache alone (its idle rows are free in vLLM's count), over all rows."""
    rows = stats["cache_rows"]
    if not rows:
        return 0.0
    return (rows - stats["cache_rows_free"] - stats.get("prefix_cache_evictable_rows", 0)) / rows


class VllmMetrics:
    """The `vllm:` instruments of one server, in `registry`, labelled model_name / engine "0".

    max_model_len sizes the token-count buckets (as vLLM's); cache_info: labels of
    `vllm:cache_config_info` (a gauge at 1)."""

    def __init__(self, registry: CollectorRegistry, engine, *, model_name: str, max_model_len: int,
                 cache_info: dict[str, str] | None = None):
        self.labels = (model_name, "0")
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
                         "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", TOKEN_LATENCY_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                      token_buckets)
        self.max_generation_tokens = hist("vllm:request_max_num_generation_tokens",
                                          "Histogram of maximum number of requested generation tokens.",
                                          token_buckets)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", token_buckets)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        registry.register(_EngineCollector(engine, self.labels, cache_info or {}))

    def finished(self, reason: str | None):
        """The request_success child of an engine finish reason (None: abort)."""
        return self.success.get(reason or "abort", self.success["stop"])


class _EngineCollector:
    """vLLM's engine-wide families, read from the engine's snapshot at scrape time."""

    def __init__(self, engine, labels: tuple[str, str], cache_info: dict[str, str]):
        self.engine, self.labels, self.cache_info = engine, labels, cache_info

    def describe(self):
        return []

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.labels, value)
        return c

    def collect(self):
        s = self.engine.stats()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          s["running"])
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s["waiting"])
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          vllm_cache_usage(s))
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s["prompt_tokens_total"])
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            s["generation_tokens_total"])
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            s["preemptions_total"])
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            s.get("prefix_cache_queried_tokens_total", 0))
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.get("prefix_cache_reused_tokens_total", 0))
        steps = s.get("iteration_tokens")
        if steps is not None:
            h = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                      labels=LABELS)
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, steps["buckets"]), "+Inf"], steps["counts"]):
                cumulative += count
                buckets.append((bound if bound == "+Inf" else f"{float(bound)}", cumulative))
            h.add_metric(self.labels, buckets, steps["sum"])
            yield h
        if "mm_cache_queries_total" in s:   # a model with a vision tower: the processor cache, in images
            yield self._counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried "
                                "items.", s["mm_cache_queries_total"])
            yield self._counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
                                s["mm_cache_hits_total"])
        if "spec_verify_steps_total" in s:
            yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                s["spec_verify_steps_total"])
            yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                s["spec_draft_tokens_total"])
            yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                s["spec_accepted_tokens_total"])
        if self.cache_info:
            names = ["engine", *self.cache_info]
            g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=names)
            g.add_metric([self.labels[1], *self.cache_info.values()], 1)
            yield g


def cache_info(engine) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` for an AsyncEngine (or anything with its
    interface): block size, cache rows (vLLM's num_gpu_blocks), cache dtype, prefix caching,
    memory utilisation; {} when the engine does not say."""
    inner = getattr(engine, "engine", None)
    config, plan = getattr(inner, "config", None), getattr(inner, "plan", None)
    if config is None or plan is None:
        return {}
    return {"block_size": str(plan.block_size), "num_gpu_blocks": str(plan.num_rows),
            "cache_dtype": str(config.kv_cache_dtype), "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
            "gpu_memory_utilization": str(config.gpu_memory_utilization)}
