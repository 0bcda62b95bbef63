"""Helpers of the distributed tier: `k3 serve` as subprocesses on the CPU (gloo), their stderr
collected by a thread, greedy completions over HTTP."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

K3 = [str(Path(sys.executable).with_name("k3"))] if Path(sys.executable).with_name("k3").exists() else \
    [sys.executable, "-m", "k3.cli.main"]
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100 + i for i in range(17)]]


class Serve:
    """One `k3 serve` command: its process and everything it wrote to stderr."""

    def __init__(self, checkpoint, *flags: str, timeout: float = 30, command=None):
        """command: what runs `serve` (default the k3 console script; e.g. torchrun's)."""
        self.proc = subprocess.Popen([*(command or K3), "serve", "--model", str(checkpoint), "--port", "0",
                                      "--host", "127.0.0.1", "--dtype", "float64",
                                      "--kv-cache-memory", "0.02", "--served-model-name", "tiny",
                                      "--uvicorn-log-level", "warning", "--distributed-timeout", str(timeout), *flags],
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} from k3 serve (exit {self.proc.poll()}):\n{self.log}")

    def url(self) -> str:
        return self.wait_for(r"serving \S+ on (http://\S+)").group(1)

    def pids(self) -> dict[int, int]:
        """rank -> pid of the ranks this command launched."""
        self.wait_for(r"started rank")
        return {int(r): int(p) for line in self.lines for r, p in re.findall(r"rank (\d+) \(pid (\d+)\)", line)
                if "started" in line}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def greedy(url: str, prompts=PROMPTS, max_tokens: int = 8) -> list[list[str]]:
    """Greedy tokens of token-id prompts through /v1/completions."""
    body = json.dumps({"model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
                       "logprobs": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = json.loads(response.read())["choices"]
    return [c["logprobs"]["tokens"] for c in sorted(choices, key=lambda c: c["index"])]


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
