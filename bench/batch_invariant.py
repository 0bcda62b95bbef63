"""What the batch-invariant mode costs (issue 31 item 2): TPOT and throughput of
`k3.LLM(batch_invariant=True)` against the default mode, same checkpoint, same run.

    python bench/batch_invariant.py [--batches 1,8 --prompt 32 --tokens 16 --dtype float32]

For each batch size B, on each engine after a warm-up: B greedy requests at once (distinct
random prompts of `--prompt` tokens, `--tokens` each, EOS ignored), timed per engine step: mean
TTFT, mean TPOT (a request's last token minus its first, over `--tokens` - 1) and generated
tokens / wall time; the two modes alternate, `--repeats` times, and the median run of each is
reported with the ratios (mode / default). The mode runs each step as one forward on the
batch-invariant kernels (docs/batch-invariance.md: fixed-tree sums, fixed-shape GEMM row blocks,
scalar-path transcendental functions, KDA token by token in decode's order, absorbed MLA for
every query), so what it costs is those kernels' own price, not a forward per token.
`--smoke`: one small batch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import k3
from k3.cli.checkpoint import init_checkpoint


def measure(llm, prompts, tokens: int) -> dict:
    """One run of all `prompts` at once (greedy, EOS ignored, `tokens` each), timed per engine
    step: mean TTFT, mean TPOT ((last token - first token) / (tokens - 1) per request) and
    generated tokens / wall time."""
    engine = llm.engine
    params = k3.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    first, last = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs[0].token_ids:
                now = time.perf_counter() - start
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    elapsed = time.perf_counter() - start
    return {"ttft_ms": round(1e3 * sum(first.values()) / len(first), 1),
            "tpot_ms": round(1e3 * sum((last[k] - first[k]) / (tokens - 1) for k in first) / len(first), 2),
            "tokens_per_s": round(len(prompts) * tokens / elapsed, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    prompt_len, tokens = (8, 3) if args.smoke else (args.prompt, args.tokens)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False)
        kw = dict(dtype=args.dtype, load_progress=False, max_num_seqs=max(batches), kv_cache_memory_gib=0.25, gpu_memory_utilization=0.4,
                  skip_tokenizer_init=True)
        engines = {"default": k3.LLM(str(ckpt), batch_invariant=False, **kw),
                   "batch_invariant": k3.LLM(str(ckpt), batch_invariant=True, **kw)}
        vocab = engines["default"].engine.model.cfg.vocab_size
        rows = []
        for b in batches:
            prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
            for llm in engines.values():
                measure(llm, prompts[:1], 2)                                # warm-up
            runs = {mode: [] for mode in engines}
            for _ in range(1 if args.smoke else args.repeats):
                for mode, llm in engines.items():
                    runs[mode].append(measure(llm, prompts, tokens))
            row = {"batch": b, **{mode: sorted(r, key=lambda x: x["tokens_per_s"])[len(r) // 2]
                                  for mode, r in runs.items()}}
            d, m = row["default"], row["batch_invariant"]
            row["tpot_ratio"] = round(m["tpot_ms"] / d["tpot_ms"], 2)
            row["throughput_ratio"] = round(m["tokens_per_s"] / d["tokens_per_s"], 3)
            row["ttft_ratio"] = round(m["ttft_ms"] / d["ttft_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = {"preset": args.preset, "dtype": args.dtype, "prompt_tokens": prompt_len, "tokens": tokens,
                  "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
