"""/v1/completions, /v1/models, /health, /version, /metrics."""

from __future__ import annotations

import re

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from serve_support import MAX_MODEL_LEN, MODEL


def test_completion_text_prompt_with_logprobs(client, engine):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp_) for top, lp_ in zip(lp.top_logprobs,
                                                                                                lp.token_logprobs))
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("Hello there", allow_special=False))
    assert r.usage.completion_tokens == 5


def test_completion_token_ids_and_batch(client):
    ids = [5, 6, 7, 8]
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    batch = client.completions.create(model=MODEL, prompt=[ids, [9, 10]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 6 and batch.usage.completion_tokens == 16
    texts = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
    assert len(texts.choices) == 2


def test_completion_streaming_and_stop(client):
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    text = whole.choices[0].text
    stop = text[3:5]
    stopped = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(stop)]
    batch = list(client.completions.create(model=MODEL, prompt=["abc", "xyz"], max_tokens=3, stream=True))
    assert {c.choices[0].index for c in batch} == {0, 1}


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    card = client.models.retrieve(MODEL)
    assert card.owned_by == "k3" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve("alias").id == "alias"


def test_health_version_openapi(server):
    with httpx.Client(base_url=server.url) as c:
        health = c.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}     # a small JSON body
        assert c.get("/version").json()["version"]
        paths = c.get("/openapi.json").json()["paths"]
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(paths)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def test_metrics(client, server, engine):
    with httpx.Client(base_url=server.url) as c:
        before = c.get("/metrics").text
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
        response = c.get("/metrics")
    after = response.text
    assert response.headers["content-type"].startswith("text/plain")
    reason = '{finished_reason="length"}'
    assert _metric(after, "k3:request_success_total", reason) == _metric(before, "k3:request_success_total",
                                                                         reason) + 3
    gen = _metric(after, "k3:generation_tokens_total") - _metric(before, "k3:generation_tokens_total")
    assert gen == 3 + 4
    assert _metric(after, "k3:prompt_tokens_total") > _metric(before, "k3:prompt_tokens_total")
    for name in ("k3:time_to_first_token_seconds", "k3:time_per_output_token_seconds",
                 "k3:e2e_request_latency_seconds"):
        assert _metric(after, f"{name}_count") >= _metric(before, f"{name}_count") + 2
    stats = engine.stats()
    assert _metric(after, "k3:cache_rows_total") == stats["cache_rows"]
    for name in ("k3:num_requests_running", "k3:num_requests_waiting", "k3:cache_usage_perc",
                 "k3:cache_rows_used", "k3:num_preemptions_total"):
        _metric(after, name)
    assert "_created" not in after
