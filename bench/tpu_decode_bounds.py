"""Decode graphs at context bounds against full-width graphs on the tpu platform (torch-xla on
PJRT's CPU device): the same k3-tiny engine decodes the same requests with the bounds on
(`XlaGraphRunner.table_width_buckets`: the narrowest compiled bound that holds the batch's
longest sequence) and off (the full-width graph: every sequence reads max_model_len positions),
alternating, so both see the same machine load.

    PJRT_DEVICE=CPU python bench/tpu_decode_bounds.py --out tpu_decode_bounds.json   # k3[tpu] venv

Figures: the median step time of each run (decode steps; the bounded runs' first-use compiles
are in the warm-up), the ratio full / bounded, and the greedy tokens' equality. PJRT's CPU
client is not a TPU: a k3-tiny step there is mostly the step's re-trace in Python, so the ratio
says how much of a CPU step the gathered positions are, not what a TPU gains.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tpu_decode_bounds.json")
    parser.add_argument("--max-model-len", type=int, default=4096, help="k3-tiny's longest (its max position)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=4, help="prompt tokens (contexts stay under 256)")
    parser.add_argument("--tokens", type=int, default=24, help="decoded tokens a request, a run")
    parser.add_argument("--rounds", type=int, default=3, help="bounded / full run pairs")
    args = parser.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")

    import torch
    import torch_xla  # noqa: F401  (the tpu platform's device)

    from k3.cli.checkpoint import init_checkpoint
    from k3.engine.engine import EngineConfig, LLMEngine
    from k3.engine.params import SamplingParams

    ckpt = init_checkpoint("k3-tiny", tempfile.mkdtemp(prefix="k3-tiny-bounds-"), progress=False)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(ckpt), platform="tpu", dtype="float32", load_progress=False,
                                    max_num_seqs=args.batch, max_num_batched_tokens=32,
                                    max_model_len=args.max_model_len, kv_cache_memory_gib=0.5,
                                    graph_batch_sizes=(args.batch,)))
    graphs = engine.runner.graphs
    if graphs is None or not graphs.bounded:
        raise SystemExit("the tpu engine has no bounded decode graphs (XlaGraphRunner.table_width_buckets)")
    bounds = list(graphs.bounds)
    print(f"[{time.perf_counter() - t0:6.1f} s] engine built: bounds {bounds} tokens, "
          f"{graphs.max_pages} pages of {graphs.block_size}", flush=True)

    def run(tag: str, tokens: int) -> tuple[list[list[int]], float]:
        for i in range(args.batch):
            prompt = [(7 * i + 13 * j) % 300 + 1 for j in range(args.prompt)]
            engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        done, steps = {}, []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps.append(time.perf_counter() - start)
        return [done[f"{tag}{i}"] for i in range(args.batch)], statistics.median(steps)

    def full_width(on: bool) -> None:
        graphs.bounds = [graphs.max_tokens] if on else bounds

    run("warm-bounded", 4)                       # the replays' first compiles
    full_width(True)
    run("warm-full", 4)                          # the full-width graph, captured on its first use
    rows = []
    for r in range(args.rounds):
        full_width(False)
        tok_b, bounded_s = run(f"b{r}-", args.tokens)
        full_width(True)
        tok_f, full_s = run(f"f{r}-", args.tokens)
        rows.append({"bounded_ms": bounded_s * 1e3, "full_ms": full_s * 1e3, "same_tokens": tok_b == tok_f})
        print(f"[{time.perf_counter() - t0:6.1f} s] round {r}: median step bounded {bounded_s * 1e3:.1f} ms, "
              f"full width {full_s * 1e3:.1f} ms, same tokens {tok_b == tok_f}", flush=True)
    bounded_ms = statistics.median(row["bounded_ms"] for row in rows)
    full_ms = statistics.median(row["full_ms"] for row in rows)
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{host.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__, "torch_xla": torch_xla.__version__, "preset": "k3-tiny", "dtype": "float32",
        "args": vars(args), "bounds": bounds, "block_size": graphs.block_size, "max_pages": graphs.max_pages,
        "late_captures": graphs.late_captures, "rounds": rows,
        "bounded_ms": bounded_ms, "full_ms": full_ms, "full_over_bounded": full_ms / bounded_ms,
        "same_tokens": all(row["same_tokens"] for row in rows),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"bounded {bounded_ms:.1f} ms, full width {full_ms:.1f} ms a step: {full_ms / bounded_ms:.2f}x; "
          f"tokens equal: {result['same_tokens']}; {args.out}")


if __name__ == "__main__":
    main()
