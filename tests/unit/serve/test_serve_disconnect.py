"""A client that goes away mid-request: its request is aborted at once and every cache row
comes back; the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from serve_support import MODEL, wait_rows_free

LONG = 600  # tokens the requests would generate if nobody stopped them (~15 s here)


def _wait_running(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["running"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)


def _aborts(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    line = [x for x in text.splitlines() if x.startswith('k3:request_success_total{finished_reason="abort"}')]
    return float(line[0].split()[-1]) if line else 0.0


def test_disconnect_mid_stream_aborts(server, engine, client):
    aborts = _aborts(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": LONG, "stream": True}
    start = time.monotonic()
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    events += 1
                if events >= 4:
                    break
    stats = wait_rows_free(engine, timeout=5)
    assert stats["running"] == 0 and stats["cache_rows_free"] == stats["cache_rows"]
    assert time.monotonic() - start < 8  # aborted, not run to the end
    assert _aborts(server) == aborts + 1
    assert client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2).choices


def test_disconnect_while_waiting_for_a_non_streaming_answer(server, engine):
    payload = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": LONG, "n": 2}).encode()
    host, port = "127.0.0.1", server.port
    start = time.monotonic()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        _wait_running(engine)
    stats = wait_rows_free(engine, timeout=5)
    assert stats["running"] == 0 and stats["cache_rows_free"] == stats["cache_rows"]
    assert time.monotonic() - start < 8


def test_disconnect_during_a_batch_of_prompts(server, engine):
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    break
    stats = wait_rows_free(engine, timeout=5)
    assert stats["running"] == 0 and stats["cache_rows_free"] == stats["cache_rows"]


class _Stalled:
    """An engine whose requests never produce a token (stuck in a queue), recording aborts."""

    def __init__(self, real):
        self.engine, self.tokenizer, self.dead, self.aborted = real.engine, real.tokenizer, None, []
        self.stats = real.stats

    async def generate(self, request_id, prompt, params):
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            self.aborted.append(request_id)


def test_disconnect_before_the_first_token(engine):
    from k3.serve import build_app
    from serve_support import LiveServer

    stalled = _Stalled(engine)
    with LiveServer(build_app(stalled, served_model_name=MODEL)) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                next(response.iter_lines())  # the role chunk; no token will follow
        deadline = time.monotonic() + 5
        while not stalled.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(stalled.aborted) == 1
