"""LoRA through the HTTP server (k3-tiny): adapters from --lora-modules and from
/v1/load_lora_adapter are listed by /v1/models and selected by `model`; an unknown model is a
404 OpenAI error; unloading takes an adapter away; bad adapter folders are 400s naming the
problem; requests of two adapters never share cached prefixes."""

from __future__ import annotations

import sys
from pathlib import Path

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest

from k3.config import K3Config
from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.model import K3ForCausalLM
from k3.serve import build_app

from serve_support import MODEL, LiveServer

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_files import write_adapter  # noqa: E402

PROMPT = list(range(1, 70))      # token ids: four 16-token prefix units and a tail


@pytest.fixture(scope="module")
def lora_server(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-adapters")
    meta = K3ForCausalLM(K3Config.preset("k3-tiny"), device="meta")
    folders = {name: write_adapter(root / name, meta, rank=r, seed=i, std=0.2)
               for i, (name, r) in enumerate((("a", 4), ("b", 8)))}
    bad = write_adapter(root / "bad", meta, rank=4)
    (bad / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 8}')
    engine = AsyncEngine(LLMEngine(EngineConfig(
        model=str(checkpoint), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=512, load_progress=False,
        enable_prefix_caching=True, enable_lora=True, lora_modules={"a": str(folders["a"])}, max_loras=2,
        max_lora_rank=8)))
    with LiveServer(build_app(engine, served_model_name=MODEL)) as live:
        yield live, engine, folders, bad
    engine.shutdown()


def _complete(url, model):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 3,
                                                  "temperature": 0, "logprobs": 1}, timeout=60)
    return r


def _hits(engine):
    return engine.stats()["prefix_cache_hits_total"]     # taken before the answer was delivered


def test_load_select_unload_through_the_server(lora_server):
    live, engine, folders, bad = lora_server
    url = live.url
    ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert ids == [MODEL, "a"]
    r = _complete(url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folders["b"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
    cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert cards["b"]["parent"] == MODEL and cards["b"]["root"] == str(folders["b"])
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folders["b"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]

    base, a, b = (_complete(url, m) for m in (MODEL, "a", "b"))
    assert [x.status_code for x in (base, a, b)] == [200, 200, 200]
    assert a.json()["model"] == "a"
    lps = [x.json()["choices"][0]["logprobs"]["token_logprobs"] for x in (base, a, b)]
    assert lps[0] != lps[1] and lps[1] != lps[2] and lps[0] != lps[2]

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
    assert _complete(url, "b").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(bad)})
    assert r.status_code == 400 and "rank 64 is above max_lora_rank 8" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_prefix_caching_never_shares_across_adapters(lora_server):
    """The same prompt on a, then b, then b again: b's first request reuses nothing of a's
    rows (and answers as b does without any cache), its second reuses b's."""
    live, engine, folders, _ = lora_server
    url = live.url
    httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b2", "lora_path": str(folders["b"])})
    try:
        first_a = _complete(url, "a").json()
        start = _hits(engine)
        first_b = _complete(url, "b2").json()
        assert _hits(engine) == start, "b2 must not reuse a's cached prefix"
        again_b = _complete(url, "b2").json()
        assert _hits(engine) == start + 1
        lp = [x["choices"][0]["logprobs"]["token_logprobs"] for x in (first_a, first_b, again_b)]
        assert lp[0] != lp[1]
        assert lp[1] == pytest.approx(lp[2], abs=1e-4)      # the cached prefix gives b2's own answer
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b2"})


@pytest.mark.parametrize("extra, pattern", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "'a' is not name=path"),
    (["--enable-lora", "--lora-modules", "a=/nonexistent-adapter"], "LoRA adapter /nonexistent-adapter: not a folder"),
    (["--enable-lora", "--tensor-parallel-size", "2"], "does not combine with tensor_parallel_size"),
], ids=["modules-without-enable", "not-name-path", "missing-folder", "tensor-parallel"])
def test_serve_flags_are_checked(capsys, checkpoint, extra, pattern):
    import re

    from k3.cli.main import main

    assert main(["serve", "--model", str(checkpoint), "--port", "0", *extra]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("k3: error: ")]
    assert len(err) == 1 and re.search(re.escape(pattern), err[0]), err


def test_lora_modules_take_vllm_json():
    from k3.cli.serve import lora_modules

    assert lora_modules(['{"name": "x", "path": "/p", "base_model_name": "m"}', "y=/q"]) == {"x": "/p", "y": "/q"}


def test_the_lora_routes_exist_only_with_lora(server):
    """The session server's engine has no LoRA: the routes are unknown (404), as on vLLM
    without runtime LoRA updating; an adapter name there is an unknown model."""
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404 and "error" in r.json()
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL, "alias"]
