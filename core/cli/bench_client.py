"""The load generator of `k3 bench serve`: streamed OpenAI-compatible requests over httpx2
(the HTTP client openai and huggingface_hub use).

`run_load` sends every prompt to `base_url + endpoint` (`/v1/completions` for the `openai`
backend, `/v1/chat/completions` for `openai-chat`), streaming, with `stream_options.include_usage`
so the server's own token counts come back. Arrivals follow vLLM's `bench serve`: all at once at
an infinite --request-rate, else gaps drawn from a gamma distribution of mean 1 / rate and shape
--burstiness (1: a Poisson process); --max-concurrency caps the requests in flight (a semaphore).
Each request's timings follow vLLM's client: TTFT is the first chunk with `choices`, every later
one adds an inter-chunk latency (ITL), E2E latency ends at the last; a request fails on an HTTP
error, a stream without chunks or a transport error (its `error` says which). httpx2 is imported
when the load runs, not with this module.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from .bench_prompts import BenchPrompt

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestOutput:
    """One request's outcome: timings in seconds, token counts from the server's usage."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def payload(backend: str, model: str, prompt: BenchPrompt, *, ignore_eos: bool, temperature: float) -> dict:
    """The JSON body of one streamed request."""
    body: dict = {"model": model, "max_tokens": prompt.output_len, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
    else:
        body["prompt"] = prompt.prompt
    return body


def _chunk_text(backend: str, choice: dict) -> str:
    if backend == "openai-chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return choice.get("text") or ""


async def send_request(client, url: str, backend: str, body: dict, prompt: BenchPrompt,
                       headers: dict[str, str]) -> RequestOutput:
    """Send one streamed request and time its chunks (never raises: failures are in `error`)."""
    out = RequestOutput(prompt_len=prompt.prompt_len or 0)
    start = last = time.perf_counter()
    first = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {' '.join(text.split())[:300]}"
                return out
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if not first:
                        first, out.ttft = True, now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.generated_text += _chunk_text(backend, chunk["choices"][0])
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"].get("completion_tokens")
                    out.prompt_len = chunk["usage"].get("prompt_tokens") or out.prompt_len
        if not first:
            out.error = "the stream ended without a chunk (no time to first token)"
            return out
        out.latency, out.success = last - start, True
    except Exception as e:          # transport errors, bad JSON: the request failed, the run goes on
        out.error = f"{type(e).__name__}: {e}"
    return out


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """The wait before each request after the first: 0 at an infinite rate, else gamma(shape =
    burstiness, scale = 1 / (rate * burstiness)) draws (mean 1 / rate)."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


async def run_load(base_url: str, backend: str, model: str, prompts: list[BenchPrompt], *, endpoint: str | None = None,
                   request_rate: float = float("inf"), burstiness: float = 1.0, max_concurrency: int | None = None,
                   ignore_eos: bool = False, temperature: float = 0.0, api_key: str | None = None,
                   timeout: float = 6 * 3600, seed: int = 0, progress: bool = True) -> tuple[list[RequestOutput], float]:
    """Send every prompt (see the module); returns the outputs in prompt order and the run's
    wall time in seconds."""
    import httpx2 as httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + (endpoint or ENDPOINTS[backend])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), disable=not progress, desc="requests", unit="req")
    gaps = arrival_gaps(len(prompts), request_rate, burstiness, seed)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(max_connections=None,
                                                                                   max_keepalive_connections=None),
                                 trust_env=False) as client:
        async def one(prompt: BenchPrompt) -> RequestOutput:
            body = payload(backend, model, prompt, ignore_eos=ignore_eos, temperature=temperature)
            if gate is None:
                result = await send_request(client, url, backend, body, prompt, headers)
            else:
                async with gate:
                    result = await send_request(client, url, backend, body, prompt, headers)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and gaps[i]:
                await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(one(prompt)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration
