"""SIGTERM drains `k3 serve` (issue 32 item 2): new requests get 503 with an OpenAI error body
and Retry-After, running requests finish within --shutdown-timeout, and the ones still
running then end properly -- a stream with a final chunk whose finish_reason is "abort" and
`[DONE]`, a non-streaming request with a JSON answer whose finish_reason is "abort" -- and the
server exits 0 with no traceback in its log. Also the engine-level `finish_all`."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

try:
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

from k3.engine.params import SamplingParams


def _start(checkpoint, *flags):
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli.main", "serve", "--model", str(checkpoint), "--port", "0",
                             "--host", "127.0.0.1", "--served-model-name", "tiny", "--kv-cache-memory", "0.02", "--platform", "reference",
                             "--dtype", "float32", "--max-model-len", "1024", "--uvicorn-log-level", "warning", *flags],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for line in list(lines):
            if m := re.search(r"k3: serving tiny on (http://127\.0\.0\.1:\d+)", line):
                return proc, m.group(1), lines
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    raise AssertionError("no serving notice:\n" + "".join(lines))


def _long(stream: bool, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def test_sigterm_drains_then_ends_the_rest_cleanly(checkpoint):
    proc, url, lines = _start(checkpoint, "--shutdown-timeout", "1.5")
    events, answers = [], {}
    try:
        with httpx.Client(timeout=60) as client:
            first_chunk = threading.Event()

            def stream_long():
                with client.stream("POST", url + "/v1/completions", json=_long(True, 1000)) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            first_chunk.set()

            def long_plain():
                answers["long"] = client.post(url + "/v1/completions", json=_long(False, 1000)).json()

            threads = [threading.Thread(target=f) for f in (stream_long, long_plain)]
            for t in threads:
                t.start()
            assert first_chunk.wait(60)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = client.post(url + "/v1/completions", json=_long(False, 2))
            health = client.get(url + "/health")
            for t in threads:
                t.join(timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert health.status_code == 503
        assert events[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finals[-1] == "abort" and finals.count("abort") == 1 and all(f is None for f in finals[:-1])
        assert answers["long"]["choices"][0]["finish_reason"] == "abort"
        assert 0 < answers["long"]["usage"]["completion_tokens"] < 1000
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "draining" in log


def test_requests_that_finish_within_the_timeout_complete(checkpoint):
    proc, url, lines = _start(checkpoint, "--shutdown-timeout", "30")
    try:
        with httpx.Client(timeout=60) as client:
            answer = {}
            t = threading.Thread(target=lambda: answer.update(
                client.post(url + "/v1/completions", json=_long(False, 40)).json()))
            t.start()
            time.sleep(0.3)                      # the request is running
            proc.send_signal(signal.SIGTERM)
            t.join(timeout=60)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_finish_all_ends_every_open_stream(engine):
    """AsyncEngine.finish_all: each open stream's last output finished with "abort", rows freed."""
    from serve_support import wait_rows_free

    async def run():
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True, n=2)
        stream = engine.generate("drain-1", [5, 6, 7], params)
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                engine.finish_all("abort")
        return outs

    outs = asyncio.run(run())
    last = outs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 500 for c in last.outputs)
    stats = wait_rows_free(engine)
    assert stats["cache_rows_free"] == stats["cache_rows"]
