"""`k3 generate` against `k3 serve` at one request, same checkpoint, same platform, same run
(issue 28 item 7: generate should decode as fast per token as the server).

    python bench/generate_vs_serve.py [--preset k3-tiny] [--dtype bfloat16] [--max-tokens 64]
                                      [--repeats 3] [--platform NAME] [--out FILE]

Writes a random checkpoint of `--preset`, starts one `k3 serve` on it (on an accelerator each
side takes 0.4 of the device's memory, so both fit), then alternates
`--repeats` times: one `k3 generate --prompt` (its own summary line gives the time per output
token) and one streaming /v1/completions request to the server with the same raw prompt,
greedy (time per output token: from the first streamed chunk to the last, over the tokens
between them, counted by their logprobs).
Each side decodes `--max-tokens` tokens (the server ignores EOS; generate's count is what it
reports: a random model rarely samples EOS within 64 tokens). Prints one JSON object: the
median TPOT of each side and generate / serve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
K3 = [sys.executable, "-m", "k3.cli.main"]


def start_server(checkpoint: Path, args) -> tuple[subprocess.Popen, str]:
    cmd = [*K3, "serve", str(checkpoint), "--port", "0", "--host", "127.0.0.1", "--served-model-name", "m",
           "--dtype", args.dtype, "--kv-cache-memory", "0.25", "--gpu-memory-utilization", "0.4",
           "--uvicorn-log-level", "warning",
           *(["--platform", args.platform] if args.platform else [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"k3 serve exited with code {proc.returncode} before serving")
        if m := re.search(r"serving \S+ on (http://\S+)", line):
            return proc, m.group(1)
    proc.kill()
    raise SystemExit("k3 serve did not start within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server start_server started (SIGINT, then kill after 30 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def serve_tpot(url: str, max_tokens: int) -> tuple[float, int]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0}
    arrivals, tokens = [], 0
    with httpx.Client(timeout=300) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                n = len((choice.get("logprobs") or {}).get("tokens") or [])
                if n:
                    tokens += n
                    arrivals.append((time.perf_counter(), tokens))
    if tokens != max_tokens or len(arrivals) < 2:
        raise SystemExit(f"the server streamed {tokens} tokens in {len(arrivals)} chunks, expected {max_tokens}")
    (t0, n0), (t1, n1) = arrivals[0], arrivals[-1]
    return (t1 - t0) / (n1 - n0), tokens


def generate_tpot(checkpoint: Path, args) -> tuple[float, int, str]:
    cmd = [*K3, "generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-tokens", str(args.max_tokens),
           "--temperature", "0", "--dtype", args.dtype, "--kv-cache-memory", "0.25", "--gpu-memory-utilization", "0.4",
           *(["--platform", args.platform] if args.platform else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"k3 generate failed: {done.stderr[-2000:]}")
    m = re.search(r"(\d+) generated, .*time per output token ([\d.]+) ms\) on (\S+),", done.stderr)
    if m is None:
        raise SystemExit(f"no summary line in k3 generate's output: {done.stderr[-1000:]}")
    return float(m.group(2)) / 1000, int(m.group(1)), m.group(3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--platform", default=None, help="default: what k3 serve and k3 generate pick")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from k3.cli.checkpoint import init_checkpoint

    gen, srv, served_tokens, gen_tokens, platform_name = [], [], [], [], None
    with tempfile.TemporaryDirectory(prefix="k3-bench-gen-") as tmp:
        checkpoint = init_checkpoint(args.preset, Path(tmp) / args.preset, progress=False)
        proc, url = start_server(checkpoint, args)
        try:
            serve_tpot(url, 8)                                           # warm-up (graphs, first compiles)
            for i in range(args.repeats):
                t, n, platform_name = generate_tpot(checkpoint, args)
                gen.append(t)
                gen_tokens.append(n)
                t, n = serve_tpot(url, args.max_tokens)
                srv.append(t)
                served_tokens.append(n)
                print(f"repeat {i + 1}/{args.repeats}: generate {gen[-1] * 1000:.2f} ms, serve {srv[-1] * 1000:.2f} ms "
                      "a token", file=sys.stderr)
        finally:
            stop_server(proc)
    g, s = statistics.median(gen), statistics.median(srv)
    report = {"benchmark": "generate_vs_serve", "preset": args.preset, "dtype": args.dtype,
              "platform": platform_name, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "generate_tpot_ms": [round(x * 1000, 3) for x in gen], "serve_tpot_ms": [round(x * 1000, 3) for x in srv],
              "generate_tokens": gen_tokens, "serve_tokens": served_tokens,
              "median_generate_tpot_ms": round(g * 1000, 3), "median_serve_tpot_ms": round(s * 1000, 3),
              "generate_over_serve": round(g / s, 3)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
