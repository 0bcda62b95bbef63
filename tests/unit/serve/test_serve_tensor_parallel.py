"""`k3 serve --tensor-parallel-size 2` on the CPU (two ranks over gloo) gives the same greedy
tokens as size 1 (float64 tiny model), through the real command line, for text and for a chat
with an image (the TP leader encodes it and sends the rows to the other rank)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

K3 = [str(Path(sys.executable).with_name("k3"))] if Path(sys.executable).with_name("k3").exists() else \
    [sys.executable, "-m", "k3.cli.main"]


def _serve(checkpoint, tp: int):
    proc = subprocess.Popen([*K3, "serve", "--model", str(checkpoint), "--port", "0", "--host", "127.0.0.1", "--dtype", "float64",
                             "--kv-cache-memory", "0.02", "--tensor-parallel-size", str(tp),
                             "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    for line in proc.stderr:
        found = re.search(r"serving \S+ on (http://\S+)", line)
        if found:
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"k3 serve --tensor-parallel-size {tp} did not start")


def _completion(url: str) -> list[str]:
    body = json.dumps({"model": "tiny", "prompt": [[5, 6, 7, 8, 9, 10], [40, 41, 42]], "max_tokens": 8,
                       "temperature": 0, "logprobs": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = json.loads(response.read())["choices"]
    return [c["logprobs"]["tokens"] for c in sorted(choices, key=lambda c: c["index"])]


def _image_chat(url: str) -> tuple[str, int]:
    import base64
    import io

    import torch
    from PIL import Image

    def image(seed: int) -> dict:
        pixels = torch.randint(0, 256, (40, 60, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    # two images: with TP 2 each rank encodes one (mm_encoder_tp_mode data)
    content = [{"type": "text", "text": "Look:"}, image(0), image(1)]
    body = json.dumps({"model": "tiny", "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.loads(response.read())
    return out["choices"][0]["message"]["reasoning_content"] or out["choices"][0]["message"]["content"], \
        out["usage"]["prompt_tokens"]


def test_tp2_serves_the_same_tokens(checkpoint):
    results = []
    for tp in (1, 2):
        proc, url = _serve(checkpoint, tp)
        try:
            results.append((_completion(url), _image_chat(url)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert results[0] == results[1] and all(len(tokens) == 8 for tokens in results[0][0])
    assert results[0][1][0]
