"""Image chat end to end through the OpenAI client against `k3 serve`, on any platform (issue 30's
done-when: the CPU reference platform and the nvidia platform).

    python bench/vision_serve_check.py [--platform nvidia] [--dtype bfloat16] [--out FILE]

Writes a random k3-tiny checkpoint (k3-tiny carries its tiny MoonViT tower), starts `k3 serve` on
it and, through the `openai` client (thinking off, greedy):

- a text-only turn ("Describe this picture."), then the same turn with a --side px PNG as a data
  URL: HTTP 200, completion tokens, a finish reason, no error; the image turn's prompt is longer
  by at least the image's placeholder count (the navit plan's);
- the image turn again, then streamed: both reuse the cached image prefix (the prefix cache's
  reused-token counter on /metrics grows) and give the same text (the cold first answer is
  recorded beside them, not required to match: in bf16 a full prefill and a resumed one may
  split a near-tie of random weights differently);
- a truncated PNG: a 400 whose message names the problem;
- /metrics: the image counters (k3:mm_* and vLLM's vllm:mm_cache_*) count the requests' images.

Prints one JSON object (answers, usage, latencies, every check) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from generate_vs_serve import start_server, stop_server

QUESTION = "Describe this picture."
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


def png(side: int, seed: int = 0) -> bytes:
    from PIL import Image

    pixels = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def image_tokens(side: int) -> int:
    """Placeholders a side x side image takes in k3-tiny's prompt (the navit plan)."""
    from k3.engine.media import IN_PATCH_LIMIT, PATCH_LIMIT_ON_ONE_SIDE
    from k3.presets import TINY_VISION_CONFIG
    from k3.vision.preprocess import plan_resize

    return plan_resize(side, side, patch_size=TINY_VISION_CONFIG["patch_size"],
                       merge_kernel=TINY_VISION_CONFIG["merge_kernel_size"][0], in_patch_limit=IN_PATCH_LIMIT,
                       patch_limit_on_one_side=PATCH_LIMIT_ON_ONE_SIDE).num_tokens


def messages(image: bytes | None) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


def metrics(url: str) -> dict[str, float]:
    """The unlabelled-or-first sample of every series on /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = float(m.group(2))
    return out


def run_checks(url: str, side: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    image = png(side)
    report: dict = {"image_side_px": side, "image_tokens": image_tokens(side)}
    checks: dict[str, bool] = {}

    def chat(msgs, **kw):
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=0,
                                              extra_body=NO_THINKING, **kw)
        return resp, round((time.perf_counter() - t0) * 1e3, 1)

    text, text_ms = chat(messages(None))
    before = metrics(url)
    first, first_ms = chat(messages(image))
    again, again_ms = chat(messages(image))
    after = metrics(url)
    stream = client.chat.completions.create(model="m", messages=messages(image), max_tokens=max_tokens,
                                            temperature=0, extra_body=NO_THINKING, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    answer = first.choices[0].message
    report.update({
        "text_turn": {"prompt_tokens": text.usage.prompt_tokens, "ms": text_ms},
        "image_turn": {"prompt_tokens": first.usage.prompt_tokens, "completion_tokens": first.usage.completion_tokens,
                       "finish_reason": first.choices[0].finish_reason, "content": answer.content, "ms": first_ms},
        "image_turn_again_ms": again_ms,
        "metrics_delta": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)
                          if k.startswith(("k3:mm_", "vllm:mm_", "k3:prefix_cache_reused"))},
    })
    checks["image turn answered (200, tokens, finish reason)"] = (
        first.usage.completion_tokens > 0 and first.choices[0].finish_reason in ("stop", "length")
        and bool(answer.content))
    checks["image placeholders in the prompt"] = (
        first.usage.prompt_tokens - text.usage.prompt_tokens >= report["image_tokens"])
    report["image_turn_again_content"] = again.choices[0].message.content
    report["cold_answer_equals_cached"] = again.choices[0].message.content == answer.content
    checks["same image again, streamed: the same answer"] = streamed == again.choices[0].message.content
    checks["second request reused the cached image prefix"] = (
        report["metrics_delta"].get("k3:prefix_cache_reused_tokens_total", 0) >= report["image_tokens"])
    checks["image counters on /metrics"] = (
        report["metrics_delta"].get("k3:mm_images_total", 0) == 2
        and report["metrics_delta"].get("vllm:mm_cache_queries_total", 0) == 2)
    bad = png(side, seed=1)
    try:
        chat(messages(bad[: len(bad) // 2]))
        checks["truncated image is a 400 naming it"] = False
    except openai.BadRequestError as e:
        report["truncated_image_error"] = str(e.message)
        checks["truncated image is a 400 naming it"] = e.status_code == 400 and "truncated" in str(e.message)
    report["checks"] = checks
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default=None, help="default: what k3 serve picks")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--side", type=int, default=224, help="image side in pixels (default 224: 64 image tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from k3.cli.checkpoint import init_checkpoint

    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="k3-vision-serve-") as tmp:
        checkpoint = init_checkpoint("k3-tiny", Path(tmp) / "k3-tiny", progress=False)
        proc, url = start_server(checkpoint, args)
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()   # keep the pipe drained
        try:
            report = {"benchmark": "vision_serve_check", "platform": args.platform or "default",
                      "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"), **run_checks(url, args.side,
                                                                                           args.max_tokens)}
        except Exception as e:  # report, with the server's log
            report = {"benchmark": "vision_serve_check", "error": f"{type(e).__name__}: {e}",
                      "server_log_tail": "".join(log)[-3000:], "checks": {"ran": False}}
        finally:
            stop_server(proc)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failed = [name for name, ok in report["checks"].items() if not ok]
    if failed:
        print(f"vision_serve_check: FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
