"""Bounded request cost (issue 32 item 4): a body over the limit is 413 with an OpenAI error
body before it is parsed (by Content-Length or by a chunked body passing it), /health keeps
answering promptly while a large body is tokenised (tokenising runs off the event loop), and
one request's prompts are bounded in number and in tokens (400 naming the flag)."""

from __future__ import annotations

import threading
import time

try:
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

from k3.serve import build_app
from k3.serve.limits import BodyLimit

from serve_support import MODEL, LiveServer


@pytest.fixture(scope="module")
def limited(engine):
    app = build_app(engine, served_model_name=MODEL, max_prompts_per_request=4, max_prompt_tokens_per_request=300)
    with LiveServer(BodyLimit(app, 64 << 10)) as live:
        yield live


def test_a_body_over_the_limit_is_413(limited):
    big = {"model": MODEL, "prompt": "x" * (100 << 10), "max_tokens": 1}
    r = httpx.post(limited.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-body-bytes" in r.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_413(limited):
    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    r = httpx.post(limited.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_a_body_under_the_limit_is_served(limited):
    r = httpx.post(limited.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, code, flag", [
    ({"prompt": [[5, 6]] * 5}, "too_many_prompts", "--max-prompts-per-request"),
    ({"prompt": [[7] * 100] * 4}, "too_many_prompt_tokens", "--max-prompt-tokens-per-request"),
])
def test_prompt_work_is_bounded(limited, body, code, flag):
    r = httpx.post(limited.url + "/v1/completions", json={"model": MODEL, "max_tokens": 1, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and flag in error["message"] and error["param"] == "prompt"


def test_chat_prompt_tokens_are_bounded(limited, engine):
    words = 1
    while len(engine.tokenizer.encode("word " * words)) < 400:       # over the 300 limit, under max_model_len
        words += 10
    r = httpx.post(limited.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "word " * words}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompt_tokens"


def test_health_answers_while_a_prompt_is_tokenised(engine, monkeypatch):
    """Tokenising runs in a worker thread: with a tokenizer that takes 2 s for a prompt (as a
    50 MB body would), /health still answers at once."""
    real = engine.tokenizer.encode
    started = threading.Event()

    def slow_encode(text, **kwargs):
        if text.startswith("slow:"):
            started.set()
            time.sleep(2.0)
        return real(text, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)
    app = build_app(engine, served_model_name=MODEL)
    with LiveServer(app) as live:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(
            live.url + "/v1/completions", timeout=60,
            json={"model": MODEL, "prompt": "slow: hello", "max_tokens": 1, "temperature": 0})))
        t.start()
        assert started.wait(30)
        start = time.monotonic()
        assert httpx.get(live.url + "/health", timeout=30).status_code == 200
        health_s = time.monotonic() - start
        t.join(timeout=60)
    assert result["r"].status_code == 200
    assert health_s < 1.0, health_s
