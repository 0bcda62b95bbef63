"""`k3 serve` and the vendor entrypoints: startup refusals are one line and exit 2; a real
server process starts, answers and stops cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import openai
import pytest

from k3.cli.main import build_parser, main
from k3.cli.serve import apply_defaults


def _refused(capsys, argv, pattern):
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("loading shards")]
    assert len(err) == 1 and err[0].startswith("k3: error: ") and re.search(pattern, err[0]), err


@pytest.mark.parametrize("extra,pattern", [
    (["--no-enable-prefix-caching", "--prefix-match-unit", "32"], "need prefix caching"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--decode-context-parallel-size", "2"], "must divide --tensor-parallel-size 1"),
    (["--platform", "nvidia"], "platform 'nvidia' is unavailable"),
    (["--platform", "nonesuch"], "unknown platform"),
    (["--port", "70000"], "--port"),
    # nvfp4 latents are served now (issue 25): the flag passes and the size check refuses
    (["--kv-cache-dtype", "nvfp4", "--dtype", "float32", "--kv-cache-memory", "0.0000001"], "the cache has no rows"),
], ids=["prefix-options-alone", "speculative", "auto-tools-without-parser", "dcp", "platform-unavailable",
        "platform-unknown", "port", "nvfp4-cache-too-small"])
def test_startup_refusals(capsys, checkpoint, extra, pattern):
    _refused(capsys, ["serve", "--model", str(checkpoint), "--port", "0", *extra], pattern)


def test_missing_checkpoint(capsys, tmp_path):
    _refused(capsys, ["serve", "--model", str(tmp_path / "none")], "not a checkpoint directory")


@pytest.mark.parametrize("vendor", ["nvidia", "amd", "tpu", "ppu"])
def test_vendor_entrypoint_refuses_when_absent(capsys, checkpoint, vendor):
    import importlib

    serve = importlib.import_module(f"k3.platforms.{vendor}.serve")
    assert serve.main(["--model", str(checkpoint)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"platform '{vendor}' is unavailable" in err[0]
    if vendor == "ppu":           # forceable: the refusal says how to run the forced path anyway
        assert "k3 serve --platform ppu" in err[0]
    assert serve.main(["--model", str(checkpoint), "--platform", "reference"]) == 2


def test_platform_defaults_fill_only_unset_options():
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--max-num-seqs", "3"])
    apply_defaults(args, {"max_num_seqs": 7, "gpu_memory_utilization": 0.5})
    assert args.max_num_seqs == 3 and args.gpu_memory_utilization == 0.5 and args.max_num_batched_tokens == 2048
    assert args.kv_cache_dtype == "auto" and args.max_model_len is None


def test_port_in_use(capsys, checkpoint):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        _refused(capsys, ["serve", "--model", str(checkpoint), "--host", "127.0.0.1", "--port",
                          str(busy.getsockname()[1])], "cannot listen on 127.0.0.1")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_process_end_to_end(checkpoint, stop):
    # a vLLM-style command line: positional model, -tp, --trust-remote-code, 1K, VLLM_API_KEY, prefix caching
    # on by default
    env = {k: v for k, v in os.environ.items() if k not in ("K3_API_KEY", "VLLM_API_KEY")}
    keyed = stop == signal.SIGINT         # the SIGTERM run serves without a key: one exposure warning
    if keyed:
        env["VLLM_API_KEY"] = "k"
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli.main", "serve", str(checkpoint), "--port", "0",
                             "--served-model-name", "tiny", "--kv-cache-memory", "0.02", "--platform", "reference",
                             "-tp", "1", "--trust-remote-code", "--dtype", "float32", "--max-model-len", "1K",
                             "--reasoning-parser", "kimi_k3",
                             "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--uvicorn-log-level",
                             "warning"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "k3 serve exited before serving"
            lines.append(line)
            if m := re.fullmatch(r"k3: serving tiny on http://0\.0\.0\.0:(\d+)\n", line):   # vLLM's default host
                url = f"http://127.0.0.1:{m.group(1)}"
        assert url, "no `serving` notice"
        log = "".join(lines)
        assert "k3: startup: " in log and "max_model_len 1,024 tokens" in log, log     # the startup report
        assert log.count("without --api-key") == (0 if keyed else 1), log              # default host: all interfaces
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens == 3 and r.choices[0].message.reasoning_content
        proc.send_signal(stop)  # graceful: the server returns and the engine shuts down
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_speculative_serving_streams_the_same_tokens(checkpoint):
    """--speculative-config reaches the engine: greedy output is unchanged and /metrics counts
    the verify steps."""
    from k3.engine.async_engine import AsyncEngine
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.engine.params import SamplingParams

    import asyncio

    async def tokens(engine):
        last = None
        async for out in engine.generate("q", [1, 2, 3, 1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=8, temperature=0)):
            last = out
        return last.outputs[0].token_ids

    results = []
    draft = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 2}' % checkpoint
    for spec in (None, draft):
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(checkpoint), dtype="float64", kv_cache_memory_gib=0.02,
                                                    max_num_seqs=8, load_progress=False, speculative_config=spec)))
        try:
            results.append(asyncio.run(tokens(engine)))
            stats = engine.stats()
        finally:
            engine.shutdown()
    assert results[0] == results[1] and stats["spec_verify_steps_total"] > 0
