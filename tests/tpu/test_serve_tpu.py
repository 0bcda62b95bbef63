"""`k3-serve-tpu --force --model <k3-tiny>` serves the tiny model through XLA on PJRT's CPU
device (PJRT_DEVICE=CPU: the tpu platform is forceable there, not detected) behind the OpenAI
API, driven with the official openai client: chat and completions, each plain and streamed.
Bounded: start-up (decode graph capture) within 240 s, each request within 180 s."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def _command() -> list[str]:
    script = Path(sys.executable).with_name("k3-serve-tpu")
    script = str(script) if script.exists() else shutil.which("k3-serve-tpu")
    return [script] if script else [sys.executable, "-m", "k3.platforms.tpu.serve"]


def test_k3_serve_tpu_answers_the_openai_client(ckpt, capsys):
    import openai

    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.Popen([*_command(), "--force", "--model", str(ckpt), "--port", "0", "--host", "127.0.0.1",
                             "--served-model-name", "k3-tiny", "--kv-cache-memory", "0.05", "--dtype", "float32",
                             "--max-model-len", "512", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                             "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"], stderr=subprocess.PIPE, text=True,
                            env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url, t0 = None, time.monotonic()
        while url is None and time.monotonic() < t0 + 240:
            for line in list(lines):
                if m := re.search(r"k3: serving k3-tiny on (http://127\.0\.0\.1:\d+)", line):
                    url = m.group(1)
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        assert url, "no serving notice:\n" + "".join(lines)
        assert any("tpu" in line for line in lines), "".join(lines)
        started = time.monotonic() - t0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=180, max_retries=0)
        timings = {}

        t = time.monotonic()
        chat = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi there"}],
                                              max_tokens=4, temperature=0)
        timings["chat"] = time.monotonic() - t
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1

        t = time.monotonic()
        stream = client.chat.completions.create(model="k3-tiny", messages=[{"role": "user", "content": "hi there"}],
                                                max_tokens=4, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        timings["chat stream"] = time.monotonic() - t
        assert len(pieces) >= 1 and "".join(pieces) == (chat.choices[0].message.content or "")   # greedy: the same

        t = time.monotonic()
        done = client.completions.create(model="k3-tiny", prompt="The tensor processing unit", max_tokens=5,
                                         temperature=0)
        timings["completion"] = time.monotonic() - t
        assert done.usage.completion_tokens == 5

        t = time.monotonic()
        stream = client.completions.create(model="k3-tiny", prompt="The tensor processing unit", max_tokens=5,
                                           temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream if c.choices)
        timings["completion stream"] = time.monotonic() - t
        assert text == done.choices[0].text
        with capsys.disabled():
            print(f"\n::: k3-serve-tpu on PJRT CPU: serving after {started:.1f} s; "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
