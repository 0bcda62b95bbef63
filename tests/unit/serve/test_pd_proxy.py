"""Prefill/decode disaggregation over HTTP (float64 k3-tiny, TCP stand-in on loopback): through
k3-pd-proxy a prefill instance and a decode instance answer what one instance answers,
streamed or not; a prefill instance that is down, or killed while the decode instance pulls
its rows, still gives the client the correct answer (local prefill on the decode side)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
import pytest
import torch

from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.serve import build_app
from k3.serve.pd_proxy import build_proxy

from serve_support import MODEL, LiveServer

BLOCK = 16


def _kv(role):
    return json.dumps({"kv_connector": "TCPConnector", "kv_role": role,
                       "kv_connector_extra_config": {"transfer_timeout_s": 20}})


def _server(checkpoint, **kw):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02,
                                                block_size=BLOCK, max_model_len=512, load_progress=False, **kw)))
    return engine, LiveServer(build_app(engine, served_model_name=MODEL))


@pytest.fixture(scope="module")
def cluster(checkpoint):
    ref, ref_server = _server(checkpoint)
    producer, producer_server = _server(checkpoint, kv_transfer_config=_kv("kv_producer"))
    consumer, consumer_server = _server(checkpoint, kv_transfer_config=_kv("kv_consumer"))
    servers = [ref_server, producer_server, consumer_server]
    for s in servers:
        s.__enter__()
    proxy = LiveServer(build_proxy([producer_server.url], [consumer_server.url]))
    proxy.__enter__()
    yield {"ref": ref_server, "producer": producer, "consumer": consumer, "consumer_url": consumer_server.url,
           "proxy": proxy}
    for s in [proxy, *servers]:
        s.__exit__(None, None, None)
    for e in (ref, producer, consumer):
        e.shutdown()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 400, (n,), generator=g).tolist()


def _complete(url, prompt, **kw):
    r = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0, **kw)
    return r.choices[0].text, r.usage.completion_tokens


def _stream(url, prompt):
    chunks = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _pulls(engine):
    s = engine.stats()
    return s["kv_pulls_total"], s["kv_fallbacks_total"]


def test_proxy_answers_as_one_instance(cluster):
    for seed, n in ((1, 7), (2, 2 * BLOCK), (3, 3 * BLOCK + 5)):
        prompt = _prompt(seed, n)
        pulls, fallbacks = _pulls(cluster["consumer"])
        expected = _complete(cluster["ref"].url, prompt)
        assert _complete(cluster["proxy"].url, prompt) == expected
        assert _stream(cluster["proxy"].url, prompt) == expected[0]
        assert _pulls(cluster["consumer"]) == (pulls + 2, fallbacks)          # each answer pulled, none fell back


def test_proxy_chat_streams_as_one_instance(cluster):
    messages = [{"role": "user", "content": "Tell me about prefill and decode."}]

    def chat(url, stream):
        c = _client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=stream)
        if not stream:
            return c.choices[0].message.content
        return "".join(x.choices[0].delta.content or "" for x in c if x.choices)

    expected = chat(cluster["ref"].url, False)
    assert chat(cluster["proxy"].url, False) == expected
    assert chat(cluster["proxy"].url, True) == expected


def test_proxy_passes_client_errors_and_lists_models(cluster):
    r = httpx.post(cluster["proxy"].url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2], "top_p": 7})
    assert r.status_code == 400 and "top_p" in r.text
    assert httpx.get(cluster["proxy"].url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.post(cluster["proxy"].url + "/v1/completions", content=b"{not json").status_code == 400


def test_prefill_instance_down_falls_back(cluster):
    with LiveServer(build_proxy(["http://127.0.0.1:1"], [cluster["consumer_url"]])) as proxy:
        prompt = _prompt(4, 2 * BLOCK + 1)
        assert _complete(proxy.url, prompt) == _complete(cluster["ref"].url, prompt)
        assert proxy.server.config.app.state.stats["prefill_failures"] == 1


def test_killed_prefill_instance_mid_transfer(cluster, checkpoint):
    """The producer is a process of its own, SIGKILLed after the consumer pulled its first row:
    the consumer's next read fails and it prefills itself; the client gets the right answer."""
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli.main", "serve", "--model", str(checkpoint), "--port", "0",
                             "--host", "127.0.0.1", "--served-model-name", MODEL, "--kv-cache-memory", "0.02", "--platform", "reference",
                             "--dtype", "float64", "--block-size", str(BLOCK), "--max-model-len", "512",
                             "--kv-transfer-config", _kv("kv_producer"), "--uvicorn-log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    backend = cluster["consumer"].engine.kv_consumer.backend
    try:
        url, deadline = None, time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "k3 serve exited before serving"
            if m := re.fullmatch(rf"k3: serving {MODEL} on (http://127\.0\.0\.1:\d+)\n", line):
                url = m.group(1)
        assert url, "no `serving` notice"
        prompt = _prompt(5, 4 * BLOCK + 3)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 9, "temperature": 0}
        handle = httpx.post(url + "/v1/completions", timeout=60,
                            json={**body, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        assert handle["do_remote_prefill"] and len(handle["rows"]) == 5
        reads = []

        def read_then_kill(peer, remote, local, nbytes, _read=backend.read):
            reads.append(remote)
            if len(reads) == 2:                          # one row arrived; the producer dies now
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=20)
            return _read(peer, remote, local, nbytes)

        backend.read = read_then_kill
        pulls, fallbacks = _pulls(cluster["consumer"])
        r = httpx.post(cluster["consumer_url"] + "/v1/completions", json={**body, "kv_transfer_params": handle},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert (r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]) == \
            _complete(cluster["ref"].url, prompt)
        assert len(reads) == 2 and _pulls(cluster["consumer"]) == (pulls, fallbacks + 1)
    finally:
        backend.__dict__.pop("read", None)
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
