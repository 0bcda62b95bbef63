"""The server on a speculating engine: chat answers equal the plain engine's, and /metrics
reports the verify steps, drafted and accepted tokens, mean acceptance length and the
per-position acceptance rate."""

from __future__ import annotations

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app

from serve_support import MODEL, LiveServer


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_speculative_chat_and_metrics(checkpoint):
    messages = [{"role": "user", "content": "Count: one two three one two three"}]
    answers = {}
    for name, spec in (("plain", None), ("spec", {"method": "draft_model", "model": str(checkpoint),
                                                   "num_speculative_tokens": 3})):
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02,
                                                    max_model_len=1024, max_num_seqs=8, load_progress=False,
                                                    speculative_config=spec)))
        try:
            with LiveServer(build_app(engine, served_model_name=MODEL)) as server:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                answers[name] = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, temperature=0,
                    extra_body={"chat_template_kwargs": {"thinking": False}}).choices[0].message.content
                metrics = httpx.get(server.url + "/metrics").text
        finally:
            engine.shutdown()
    assert answers["spec"] == answers["plain"]
    assert _metric(metrics, "k3:spec_decode_verify_steps_total") > 0
    assert _metric(metrics, "k3:spec_decode_num_accepted_tokens_total") == _metric(
        metrics, "k3:spec_decode_num_draft_tokens_total")                 # an identical draft
    assert _metric(metrics, "k3:spec_decode_mean_acceptance_length") > 2.0     # the last step drafts fewer
    assert _metric(metrics, 'k3:spec_decode_acceptance_rate_per_position{position="0"}') == 1.0
