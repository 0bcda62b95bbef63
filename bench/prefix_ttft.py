"""TTFT of a request sharing a long prefix, with and without prefix caching (k3-tiny, CPU).

    python bench/prefix_ttft.py [--prefix 2048 --suffix 32 --repeats 5]

Each measurement: a fresh engine; with caching, a first request warms the cache with the same
prefix and another suffix, then the measured request arrives. TTFT = time from add_request to
its first token. Medians of --repeats runs, printed as JSON. The peer is the same engine with
caching off, in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from k3.cli.checkpoint import init_checkpoint
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    engine.add_request(f"m{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ckpt = init_checkpoint("k3-tiny", tempfile.mkdtemp(prefix="k3-bench-"), progress=False)
    shared = [(7 * i + i * i % 11) % 380 + 1 for i in range(args.prefix)]
    warm = shared + [(3 * i) % 380 + 1 for i in range(args.suffix)]
    measured = shared + [(5 * i + 1) % 380 + 1 for i in range(args.suffix)]
    results = {"off": [], "hit": []}
    reused = None
    for _ in range(args.repeats):
        for mode in ("off", "hit"):
            engine = LLMEngine(EngineConfig(model=str(ckpt), load_progress=False, kv_cache_memory_gib=0.25,
                                            max_num_batched_tokens=8192, enable_prefix_caching=mode == "hit"))
            if mode == "hit":
                ttft(engine, warm)
                before = engine.prefix_cache.stats.reused_tokens
            results[mode].append(ttft(engine, measured))
            if mode == "hit":
                reused = engine.prefix_cache.stats.reused_tokens - before
    off, hit = statistics.median(results["off"]), statistics.median(results["hit"])
    print(json.dumps({"model": "k3-tiny (bf16, random weights)", "prompt_tokens": len(measured),
                      "reused_tokens": reused, "ttft_no_cache_ms": round(off * 1e3, 2),
                      "ttft_prefix_hit_ms": round(hit * 1e3, 2), "speedup": round(off / hit, 2),
                      "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
