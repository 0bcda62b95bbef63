"""Load benchmark of `k3 serve` (stops by itself; prints one JSON object on stdout).

Starts `k3 serve` on a fresh k3-tiny checkpoint (written to a temporary directory) on the CPU
reference platform, then sends the same N streaming chat requests (greedy, M tokens each, EOS
ignored) twice: all at once, and one at a time (the peer measured in the same run). Every
concurrent request must return exactly the tokens it returned alone. Reports throughput
(generated tokens/s, requests/s) and latency percentiles (TTFT, TPOT, end to end) of both.

    python bench/serve_load.py [--requests 64] [--max-tokens 32] [--dtype float64]

float64 is the default so batched and lone runs must agree token for token (DESIGN.md:
equality is tested in float64; bf16 near-ties may flip a token between batch shapes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import numpy as np

MODEL = "k3-tiny"


def start_server(checkpoint: Path, dtype: str, max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "k3.cli.main", "serve", "--model", str(checkpoint), "--port", "0",
           "--host", "127.0.0.1", "--served-model-name", MODEL, "--platform", "reference", "--dtype", dtype, "--kv-cache-memory", "0.25",
           "--max-num-seqs", str(max_num_seqs), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"k3 serve exited with code {proc.returncode} before serving")
        if m := re.search(r"serving \S+ on (http://\S+)", line):
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("k3 serve did not start within 120 s")


async def one_request(client: httpx.AsyncClient, url: str, index: int, max_tokens: int) -> dict:
    """Stream one chat request; returns its token bytes and timings."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {index}: what is {index} squared?"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"thinking": False}}
    start = time.perf_counter()
    arrivals, tokens, usage = [], [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"request {index}: HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {index}: {chunk['error']['message']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                for item in (choice.get("logprobs") or {}).get("content") or []:
                    tokens.append(bytes(item["bytes"]))
                    arrivals.append(time.perf_counter())
    end = time.perf_counter()
    if usage is None or usage["completion_tokens"] != len(tokens) or len(tokens) != max_tokens:
        raise RuntimeError(f"request {index}: {len(tokens)} tokens streamed, usage {usage}, expected {max_tokens}")
    return {"tokens": tokens, "ttft": arrivals[0] - start, "e2e": end - start,
            "tpot": (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else 0.0}


def _percentiles(values: list[float]) -> dict:
    ms = np.array(values) * 1000
    return {f"p{q}": round(float(np.percentile(ms, q)), 2) for q in (50, 90, 99)}


def summarize(results: list[dict], wall: float) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    return {"wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(results) / wall, 3), "ttft_ms": _percentiles([r["ttft"] for r in results]),
            "tpot_ms": _percentiles([r["tpot"] for r in results]), "e2e_ms": _percentiles([r["e2e"] for r in results])}


async def run_load(url: str, n: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*[one_request(client, url, -1 - i, 4) for i in range(2)])  # warm up
        start = time.perf_counter()
        together = await asyncio.gather(*[one_request(client, url, i, max_tokens) for i in range(n)])
        concurrent = summarize(together, time.perf_counter() - start)
        start = time.perf_counter()
        alone = [await one_request(client, url, i, max_tokens) for i in range(n)]
        sequential = summarize(alone, time.perf_counter() - start)
    mismatched = [i for i, (a, b) in enumerate(zip(together, alone)) if a["tokens"] != b["tokens"]]
    return {"concurrent": concurrent, "sequential": sequential, "mismatched_requests": mismatched}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    args = parser.parse_args()

    from k3.cli.checkpoint import init_checkpoint

    with tempfile.TemporaryDirectory(prefix="k3-bench-") as tmp:
        checkpoint = init_checkpoint(MODEL, Path(tmp) / MODEL, progress=False)
        proc, url = start_server(checkpoint, args.dtype, max(args.requests, 1))
        try:
            load = asyncio.run(run_load(url, args.requests, args.max_tokens))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    c, s = load["concurrent"], load["sequential"]
    report = {
        "benchmark": "serve_load", "model": MODEL, "platform": "reference (CPU)", "dtype": args.dtype,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "requests": args.requests,
        "max_tokens": args.max_tokens, "mode": "streaming chat, instruct mode, greedy, ignore_eos",
        **load, "throughput_ratio": round(c["tokens_per_s"] / s["tokens_per_s"], 2),
        "tokens_match": not load["mismatched_requests"],
    }
    print(json.dumps(report, indent=2))
    return 0 if report["tokens_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
