"""`k3-serve-ppu --force` serves tiny K3 on the CPU (the ppu plugin's torch-native kernels, forced
there: without --force it refuses, test_serve_cli.py) and answers one chat request through
HTTP: the CI tier of the ppu platform (issue 26)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import httpx2 as httpx
except ImportError:
    import httpx


def _command() -> list[str]:
    script = Path(sys.executable).with_name("k3-serve-ppu")
    script = str(script) if script.exists() else shutil.which("k3-serve-ppu")
    return [script] if script else [sys.executable, "-m", "k3.platforms.ppu.serve"]


def test_k3_serve_ppu_answers_a_chat_request(checkpoint):
    proc = subprocess.Popen([*_command(), "--force", "--model", str(checkpoint), "--port", "0", "--host", "127.0.0.1",
                             "--served-model-name", "tiny", "--kv-cache-memory", "0.02", "--dtype", "float32",
                             "--max-model-len", "1024", "--uvicorn-log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            for line in list(lines):
                if m := re.search(r"k3: serving tiny on (http://127\.0\.0\.1:\d+)", line):
                    url = m.group(1)
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        assert url, "no serving notice:\n" + "".join(lines)
        assert any("ppu" in line for line in lines), "".join(lines)          # the platform it started on
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "temperature": 0})
        print(f"ppu: serving after {started - deadline + 60:.1f} s, chat answered in {time.monotonic() - started:.1f} s")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=20)
