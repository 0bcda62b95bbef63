"""Soak benchmark of `k3 serve` (bounded, loopback; prints one JSON object on stdout).

Starts `k3 serve` on a fresh k3-tiny checkpoint (CPU reference platform, prefix caching on, a
small `--max-request-body-bytes`) and sends N requests at a fixed concurrency, a hostile mix:
well-formed chat and completion requests (streaming and not, sharing a system prompt so the
prefix cache is hit), streams the client cancels after a few chunks, requests the client gives
up on (a short client timeout), bodies over the size limit, and malformed bodies (bad JSON,
wrong types, out-of-range fields). Records the latency p50/p99 of the well-formed requests that
completed, the server's RSS over time and its slope over the last half of the run, every status
code seen, and, after the load has drained, the cache rows in use against the rows the prefix
cache holds (they must be equal: no request leaks a row). Exit status 1 when any 5xx was seen,
a row leaked, or a well-formed request got a wrong answer.

    python bench/soak.py [--requests 10000] [--concurrency 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import numpy as np

MODEL = "k3-tiny"
BODY_LIMIT = 64 << 10  # --max-request-body-bytes of the soaked server
SYSTEM = "You are a terse assistant. Answer in one short sentence. " * 4  # shared prefix
KINDS = ("ok_chat", "ok_chat_stream", "ok_completion", "cancel_stream", "client_timeout", "oversized", "malformed")
WEIGHTS = (25, 20, 15, 12, 8, 8, 12)


def start_server(checkpoint: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "k3.cli.main", "serve", "--model", str(checkpoint), "--port", "0",
           "--host", "127.0.0.1", "--served-model-name", MODEL, "--platform", "reference", "--dtype", "bfloat16",
           "--kv-cache-memory", "0.25", "--max-num-seqs", "64", "--enable-prefix-caching",
           "--max-request-body-bytes", str(BODY_LIMIT), "--shutdown-timeout", "5",
           "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"k3 serve exited with code {proc.returncode} before serving")
        if m := re.search(r"serving \S+ on (http://\S+)", line):
            stderr_tail: list[str] = []
            threading.Thread(target=_drain_stderr, args=(proc, stderr_tail), daemon=True).start()
            proc.stderr_tail = stderr_tail  # type: ignore[attr-defined]
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("k3 serve did not start within 120 s")


def _drain_stderr(proc: subprocess.Popen, tail: list[str]) -> None:
    for line in proc.stderr:
        tail.append(line)
        del tail[:-200]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def chat_body(rng: random.Random, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": f"What is {rng.randrange(1000)} plus 1?"}],
            "max_tokens": rng.randint(1, 8), "temperature": 0, "stream": stream,
            "chat_template_kwargs": {"thinking": False}}


def malformed_body(rng: random.Random) -> bytes:
    bad = [b"{not json", b"", b"[]", b'{"model": "k3-tiny"}', b'{"messages": 5, "model": "k3-tiny"}',
           json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(),
           json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
           json.dumps({"model": MODEL, "prompt": [[10 ** 12]], "max_tokens": 2}).encode(),
           json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
           json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode()]
    return rng.choice(bad)


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, stats: dict) -> None:
    start = time.perf_counter()
    status = None
    try:
        if kind in ("ok_chat", "ok_completion"):
            path, body = ("/v1/chat/completions", chat_body(rng, False)) if kind == "ok_chat" else (
                "/v1/completions", {"model": MODEL, "prompt": SYSTEM + str(rng.randrange(1000)),
                                    "max_tokens": rng.randint(1, 8), "temperature": 0})
            r = await client.post(url + path, json=body)
            status = r.status_code
            if status == 200:
                choice = r.json()["choices"][0]
                if choice["finish_reason"] not in ("stop", "length"):
                    stats["wrong"].append(f"{kind}: finish_reason {choice['finish_reason']}")
                stats["latency"].append(time.perf_counter() - start)
        elif kind in ("ok_chat_stream", "cancel_stream"):
            body = chat_body(rng, True)
            cancel_after = rng.randint(0, 2) if kind == "cancel_stream" else None
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                status = r.status_code
                done, chunks = False, 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if "error" in json.loads(line[6:]):
                        stats["wrong"].append(f"{kind}: error event {line[:200]}")
                    chunks += 1
                    if cancel_after is not None and chunks > cancel_after:
                        break  # leaving the block closes the connection mid-stream
                if status == 200 and kind == "ok_chat_stream":
                    if not done:
                        stats["wrong"].append("stream ended without [DONE]")
                    stats["latency"].append(time.perf_counter() - start)
        elif kind == "client_timeout":
            body = chat_body(rng, rng.random() < 0.5)
            body["max_tokens"] = 64
            try:
                r = await client.post(url + "/v1/chat/completions", json=body, timeout=rng.uniform(0.01, 0.3))
                status = r.status_code
            except httpx.TimeoutException:
                status = "client_timeout"
        elif kind == "oversized":
            content = "a" * (BODY_LIMIT + rng.randint(1, 4 * BODY_LIMIT))
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            r = await client.post(url + "/v1/chat/completions", json=body)
            status = r.status_code
            if status != 413:
                stats["wrong"].append(f"oversized body answered {status}")
        else:
            r = await client.post(url + rng.choice(["/v1/chat/completions", "/v1/completions"]),
                                  content=malformed_body(rng), headers={"content-type": "application/json"})
            status = r.status_code
            if not 400 <= status < 500:
                stats["wrong"].append(f"malformed body answered {status}")
            elif "error" not in r.json():
                stats["wrong"].append(f"malformed body answered {status} without an error body")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        status = f"transport:{type(e).__name__}"
    stats["status"][f"{kind}:{status}"] += 1
    if isinstance(status, int) and status >= 500:
        stats["fivexx"] += 1


async def run_soak(url: str, pid: int, n: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    kinds = rng.choices(KINDS, weights=WEIGHTS, k=n)
    stats = {"status": Counter(), "latency": [], "wrong": [], "fivexx": 0}
    rss: list[tuple[float, float]] = []
    start = time.perf_counter()
    queue = iter(enumerate(kinds))

    async def sample_rss():
        while True:
            rss.append((time.perf_counter() - start, rss_mib(pid)))
            await asyncio.sleep(0.5)

    async def worker(wid: int):
        wrng = random.Random(seed * 1000 + wid)
        for _, kind in queue:
            await one_request(client, url, kind, wrng, stats)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*[worker(w) for w in range(concurrency)])
        wall = time.perf_counter() - start
        # drain: wait until no request runs, then compare the rows in use with the prefix cache's
        deadline = time.monotonic() + 60
        while True:
            text = (await client.get(url + "/metrics")).text
            m = {k: float(v) for k, v in re.findall(r"^(k3:[a-z_]+) ([0-9.e+]+)$", text, re.M)}
            idle = m.get("k3:num_requests_running", 1) == 0 and m.get("k3:num_requests_waiting", 1) == 0
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        text = (await client.get(url + "/metrics")).text
        m = {k: float(v) for k, v in re.findall(r"^(k3:[a-z_]+) ([0-9.e+]+)$", text, re.M)}
        health = (await client.get(url + "/health")).status_code
        sampler.cancel()
    rss.append((time.perf_counter() - start, rss_mib(pid)))
    t, mib = np.array([x for x, _ in rss]), np.array([y for _, y in rss])
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half], mib[half], 1)[0]) * 60 if half.sum() >= 2 else float("nan")
    lat = np.array(stats["latency"]) * 1000
    rows_used, prefix_rows = int(m.get("k3:cache_rows_used", -1)), int(m.get("k3:prefix_cache_rows", -1))
    return {
        "wall_s": round(wall, 1), "requests_per_s": round(n / wall, 2),
        "kinds": dict(Counter(kinds)), "status": dict(sorted(stats["status"].items())),
        "fivexx": stats["fivexx"], "wrong_answers": stats["wrong"][:20], "wrong_answer_count": len(stats["wrong"]),
        "wellformed_completed": int(lat.size),
        "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 1), "p99": round(float(np.percentile(lat, 99)), 1)}
        if lat.size else {},
        "rss_mib": {"start": round(float(mib[0]), 1), "max": round(float(mib.max()), 1),
                    "end": round(float(mib[-1]), 1), "slope_last_half_mib_per_min": round(slope, 2),
                    "samples": [[round(float(a), 1), round(float(b), 1)] for a, b in rss[:: max(1, len(rss) // 60)]]},
        "after_drain": {"cache_rows_used": rows_used, "prefix_cache_rows": prefix_rows,
                        "cache_rows_total": int(m.get("k3:cache_rows_total", -1)), "health": health},
        "rows_back_to_prefix_cache": rows_used == prefix_rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.concurrency <= 64:
        parser.error("--concurrency must be 1..64 (the server's --max-num-seqs)")

    from k3.cli.checkpoint import init_checkpoint

    with tempfile.TemporaryDirectory(prefix="k3-soak-") as tmp:
        checkpoint = init_checkpoint(MODEL, Path(tmp) / MODEL, progress=False)
        proc, url = start_server(checkpoint)
        try:
            soak = asyncio.run(run_soak(url, proc.pid, args.requests, args.concurrency, args.seed))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = "killed"
        tracebacks = sum("Traceback" in line for line in proc.stderr_tail)  # type: ignore[attr-defined]
    report = {"benchmark": "soak", "model": MODEL, "platform": "reference (CPU)", "dtype": "bfloat16",
              "prefix_caching": True, "max_request_body_bytes": BODY_LIMIT,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "requests": args.requests,
              "concurrency": args.concurrency, "seed": args.seed, **soak,
              "server_exit_code": exit_code, "server_tracebacks": tracebacks}
    report["ok"] = (soak["fivexx"] == 0 and soak["rows_back_to_prefix_cache"] and not soak["wrong_answer_count"]
                    and soak["after_drain"]["health"] == 200 and not tracebacks)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
