"""The server on an engine with prefix caching: a second turn of a conversation reuses the
first turn's prompt (counted in /metrics), answers as without caching, and every row is
either free or held by the prefix cache afterwards."""

from __future__ import annotations

import time

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
import pytest

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app

from serve_support import MODEL, LiveServer, wait_rows_free

SYSTEM = {"role": "system", "content": "You answer questions about the weather in one short sentence. " * 4}


def _engine(checkpoint, caching: bool) -> AsyncEngine:
    return AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float64", kv_cache_memory_gib=0.05,
                                              max_model_len=1024, load_progress=False,
                                              enable_prefix_caching=caching)))


@pytest.fixture(scope="module")
def engines(checkpoint):
    cached, plain = _engine(checkpoint, True), _engine(checkpoint, False)
    yield cached, plain
    cached.shutdown()
    plain.shutdown()


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_prefix_hit_through_the_server(engines):
    cached, plain = engines
    turns = [[SYSTEM, {"role": "user", "content": "Paris?"}],
             [SYSTEM, {"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "Mild."},
              {"role": "user", "content": "And Oslo?"}]]
    answers = {}
    for name, engine in (("cached", cached), ("plain", plain)):
        with LiveServer(build_app(engine, served_model_name=MODEL, reasoning_parser="kimi_k3")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            answers[name] = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0)
                             .choices[0].message.reasoning_content for m in turns]
            metrics = httpx.get(server.url + "/metrics").text
        if name == "cached":
            assert _metric(metrics, "k3:prefix_cache_queries_total") == 2
            assert _metric(metrics, "k3:prefix_cache_hits_total") == 1
            assert _metric(metrics, "k3:prefix_cache_reused_tokens_total") >= 64
            assert _metric(metrics, "k3:prefix_cache_rows") > 0
    assert answers["cached"] == answers["plain"]
    stats = wait_rows_free(plain)
    assert stats["cache_rows_free"] == stats["cache_rows"]
    deadline = time.monotonic() + 10
    while (s := cached.stats())["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s["running"] == 0
    assert s["cache_rows_free"] + s["prefix_cache_rows"] + s["prefix_cache_checkpoint_rows"] == s["cache_rows"], s
