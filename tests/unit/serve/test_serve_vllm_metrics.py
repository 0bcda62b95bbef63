"""/metrics carries every `vllm:` family a stock vLLM Grafana dashboard queries, labelled
`model_name`, with values that follow from the requests sent (token counts exact).

The names are those of vLLM's examples/observability/prometheus_grafana/grafana.json (the
series its panels' PromQL reads) and the V1 families of vllm/v1/metrics/loggers.py that
dashboards and tools read besides (per-request time per output token, iteration tokens)."""

from __future__ import annotations

import time

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app

from serve_support import MODEL, LiveServer

# series the stock dashboard's panels query (grafana.json), each with {model_name="$model_name"}
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)
# further V1 series (loggers.py) that dashboards and benchmark tools read
V1_SERIES = (
    "vllm:request_time_per_output_token_seconds_count", "vllm:time_per_output_token_seconds_count",
    "vllm:request_inference_time_seconds_count", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:iteration_tokens_total_sum", "vllm:num_preemptions_total", "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_sum", "vllm:cache_config_info",
)

PROMPT = [(7 * i) % 200 + 10 for i in range(150)]     # token ids; 150 tokens, more than two 64-token units


@pytest.fixture(scope="module")
def cached_engine(checkpoint):
    e = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", kv_cache_memory_gib=0.05,
                                           max_model_len=1024, load_progress=False, enable_prefix_caching=True)))
    yield e
    e.shutdown()


def _wait_idle(engine, timeout: float = 10.0) -> None:
    """Until no request runs or waits (the prefix cache keeps rows, so rows never all come back)."""
    deadline = time.monotonic() + timeout
    while (engine.stats()["running"] or engine.stats()["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_dashboard_series(cached_engine):
    app = build_app(cached_engine, served_model_name=[MODEL, "alias"])
    with LiveServer(app) as server:
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
        first = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        assert first.status_code == 200, first.text
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "max_tokens": 3, "stream": True},
                          timeout=60) as streamed:
            assert streamed.status_code == 200
            assert "[DONE]" in "".join(streamed.iter_text())
        _wait_idle(cached_engine)
        text = httpx.get(server.url + "/metrics").text
    samples = _samples(text)
    missing = [n for n in DASHBOARD_SERIES + V1_SERIES if n not in samples]
    assert missing == []
    for name, series in samples.items():
        if name.startswith("vllm:") and name != "vllm:cache_config_info":
            assert {s.labels.get("model_name") for s in series} == {MODEL}, name

    gen, prompt = [4, 3], [len(PROMPT)] * 2
    assert _value(samples, "vllm:prompt_tokens_total") == sum(prompt)
    assert _value(samples, "vllm:generation_tokens_total") == sum(gen)
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(samples, "vllm:request_prompt_tokens_sum") == sum(prompt)
    assert _value(samples, "vllm:request_generation_tokens_sum") == sum(gen)
    assert _value(samples, "vllm:request_generation_tokens_bucket", le="2.0") == 0    # 1-2-5 buckets
    assert _value(samples, "vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert _value(samples, "vllm:request_max_num_generation_tokens_sum") == sum(gen)
    assert _value(samples, "vllm:request_params_max_tokens_sum") == 7
    # one inter-token observation per token after each request's first
    assert _value(samples, "vllm:inter_token_latency_seconds_count") == sum(g - 1 for g in gen)
    assert _value(samples, "vllm:time_per_output_token_seconds_count") == sum(g - 1 for g in gen)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert _value(samples, f"vllm:{name}_count") == 2, name
    assert _value(samples, "vllm:e2e_request_latency_seconds_sum") >= _value(
        samples, "vllm:request_decode_time_seconds_sum")
    # prefix caching in tokens: every prompt token is queried; the repeat reuses its whole
    # 64-token units short of the last token (the first request left a KDA checkpoint there)
    unit = cached_engine.engine.prefix_cache.unit
    assert _value(samples, "vllm:prefix_cache_queries_total") == sum(prompt)
    assert _value(samples, "vllm:prefix_cache_hits_total") == (len(PROMPT) - 1) // unit * unit
    # tokens computed over all steps: each prompt less its reused tokens, then one per decode
    hit = (len(PROMPT) - 1) // unit * unit
    assert _value(samples, "vllm:iteration_tokens_total_sum") == sum(prompt) - hit + sum(g - 1 for g in gen)
    assert _value(samples, "vllm:iteration_tokens_total_bucket", le="+Inf") == _value(
        samples, "vllm:iteration_tokens_total_count")
    assert _value(samples, "vllm:num_requests_running") == 0 and _value(samples, "vllm:num_requests_waiting") == 0
    # idle: the prefix cache alone holds rows, which vLLM counts as free; k3's own gauge counts them
    assert _value(samples, "vllm:kv_cache_usage_perc") == 0
    assert _value(samples, "k3:cache_usage_perc") > 0
    info = samples["vllm:cache_config_info"][0].labels
    assert info["block_size"] == str(cached_engine.engine.plan.block_size)
    assert info["enable_prefix_caching"] == "True"
