"""`k3 serve --tensor-parallel-size 2` on the CPU (two ranks over gloo) gives the same greedy
tokens as size 1 (float64 tiny model), through the real command line, for text and for a chat
with two images, in both vision-encoder modes: "weights" (the default: each rank runs both
images through its half of the tower's heads and MLP) and "data" (each rank encodes one image,
the outputs are all-gathered)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

K3 = [str(Path(sys.executable).with_name("k3"))] if Path(sys.executable).with_name("k3").exists() else \
    [sys.executable, "-m", "k3.cli.main"]


def _serve(checkpoint, tp: int, *extra: str):
    proc = subprocess.Popen([*K3, "serve", "--model", str(checkpoint), "--port", "0", "--host", "127.0.0.1", "--dtype", "float64",
                             "--kv-cache-memory", "0.02", "--tensor-parallel-size", str(tp),
                             "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *extra],
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


def _image_chat(url: str) -> tuple[list[str], list[float], int]:
    """(the answer's tokens, their log-probs, prompt tokens) of a greedy chat turn with two images."""
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

    # two images: with TP 2 in data mode each rank encodes one
    content = [{"type": "text", "text": "Look:"}, image(0), image(1)]
    body = json.dumps({"model": "tiny", "max_tokens": 6, "temperature": 0, "logprobs": True,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        out = json.loads(response.read())
    entries = out["choices"][0]["logprobs"]["content"]
    return [e["token"] for e in entries], [e["logprob"] for e in entries], out["usage"]["prompt_tokens"]


def test_tp2_serves_the_same_tokens(checkpoint):
    results = []
    for tp, extra in ((1, ()), (2, ()), (2, ("--mm-encoder-tp-mode", "data"))):
        proc, url = _serve(checkpoint, tp, *extra)
        try:
            results.append((_completion(url), _image_chat(url)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    (text, (tokens, logprobs, prompt_tokens)), *tp2 = results
    assert all(len(t) == 8 for t in text) and len(tokens) == 6
    for text2, (tokens2, logprobs2, prompt_tokens2) in tp2:
        assert (text2, tokens2, prompt_tokens2) == (text, tokens, prompt_tokens)
        # the image rows reach the log-probs: a tower run wrong on one rank moves them (sums
        # over the ranks only reorder float64 additions; the API rounds log-probs to float32)
        assert logprobs2 == pytest.approx(logprobs, rel=0, abs=1e-6)
