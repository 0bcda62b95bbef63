"""What the batch-invariant mode costs (issue 31 item 2): TPOT and throughput of
`k3.LLM(batch_invariant=True)` against the default mode, same checkpoint, same run.

    python bench/batch_invariant.py [--batches 1,8 --prompt 32 --tokens 16 --dtype float32]

For each batch size B, on each engine after a warm-up: B greedy requests (distinct random
prompts of `--prompt` tokens, EOS ignored) once with max_tokens 1 (the prefill: TTFT) and once
with `--tokens`; TPOT = (time with `--tokens` - time with 1) / (`--tokens` - 1), throughput =
generated tokens / time with `--tokens`. Reported per B: both modes' figures and the ratios
(mode / default). The mode runs one forward per token (docs/batch-invariance.md), so its
prefill is `--prompt` decode steps per request and a decode step of B requests is B forwards.
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


def timed(llm, prompts, tokens: int) -> float:
    params = k3.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(llm, prompts, tokens: int) -> dict:
    timed(llm, prompts[:1], 2)                                           # warm-up
    first = timed(llm, prompts, 1)
    full = timed(llm, prompts, tokens)
    return {"ttft_ms": round(first * 1e3, 1), "tpot_ms": round((full - first) / (tokens - 1) * 1e3, 2),
            "tokens_per_s": round(len(prompts) * tokens / full, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    prompt_len, tokens = (8, 3) if args.smoke else (args.prompt, args.tokens)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False)
        kw = dict(dtype=args.dtype, load_progress=False, max_num_seqs=max(batches), kv_cache_memory_gib=0.25,
                  skip_tokenizer_init=True)
        engines = {"default": k3.LLM(str(ckpt), batch_invariant=False, **kw),
                   "batch_invariant": k3.LLM(str(ckpt), batch_invariant=True, **kw)}
        vocab = engines["default"].engine.model.cfg.vocab_size
        rows = []
        for b in batches:
            prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
            row = {"batch": b, **{mode: measure(llm, prompts, tokens) for mode, llm in engines.items()}}
            d, m = row["default"], row["batch_invariant"]
            row["tpot_ratio"] = round(m["tpot_ms"] / d["tpot_ms"], 2)
            row["throughput_ratio"] = round(m["tokens_per_s"] / d["tokens_per_s"], 3)
            row["ttft_ratio"] = round(m["ttft_ms"] / d["ttft_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = {"preset": args.preset, "dtype": args.dtype, "prompt_tokens": prompt_len, "tokens": tokens,
                  "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
