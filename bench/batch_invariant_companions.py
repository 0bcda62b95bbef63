"""Served log-probs of one sequence in the batch-invariant mode, bit for bit, alone and among
batch companions (issue 31 item 4 on a device): `k3.LLM(batch_invariant=True)` generates a
seeded sampled completion of a target prompt alone, then again beside 7 and 63 other requests
(random prompts of random lengths, the target at a random place, prompts chunked by the step
budget), and finally recomputes prompt + completion as a prompt (prompt log-probs) beside
companions: every token id and log-prob must be equal (`==` on the floats).

    python bench/batch_invariant_companions.py [--batches 1,8,64 --tokens 16 --dtype bfloat16]

Writes the target's tokens and log-probs per batch size and the verdicts (`--out`); exits 1
when any differ. `--smoke`: batches 1 and 3, 3 tokens (the CPU check of the script).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import k3
from k3.cli.checkpoint import init_checkpoint


def _prompts(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(4, 48))] for _ in range(n)]


def _with_companions(llm, target: list[int], params, companions: list[list[int]], rng: random.Random):
    """The target's output beside `companions` (greedy, a few tokens each), at a random place."""
    at = rng.randint(0, len(companions))
    prompts = companions[:at] + [target] + companions[at:]
    others = k3.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [others] * at + [params] + [others] * (len(companions) - at), use_tqdm=False)
    return outs[at]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens: prompts are chunked by it")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [1, 3] if args.smoke else [int(b) for b in args.batches.split(",")]
    tokens = 3 if args.smoke else args.tokens
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False)
        llm = k3.LLM(str(ckpt), dtype=args.dtype, batch_invariant=True, load_progress=False, skip_tokenizer_init=True,
                     max_num_seqs=max(batches), max_num_batched_tokens=args.budget, kv_cache_memory_gib=0.5)
        try:
            vocab = llm.engine.model.cfg.vocab_size
            target = _prompts(rng, vocab, 1)[0]
            params = k3.SamplingParams(max_tokens=tokens, temperature=1.0, seed=1234, logprobs=0, ignore_eos=True)
            runs = {}
            for b in batches:
                out = _with_companions(llm, target, params, _prompts(rng, vocab, b - 1), rng).outputs[0]
                runs[b] = {"tokens": out.token_ids,
                           "logprobs": [out.logprobs[j][t] for j, t in enumerate(out.token_ids)]}
            first = runs[batches[0]]
            full = target + first["tokens"]
            recompute = k3.SamplingParams(max_tokens=1, prompt_logprobs=0)
            again = _with_companions(llm, full, recompute, _prompts(rng, vocab, min(7, max(batches) - 1)), rng)
            scored = [again.prompt_logprobs[len(target) + j][t].logprob for j, t in enumerate(first["tokens"])]
            platform = llm.engine.platform.name
            device = str(llm.engine.device)
        finally:
            llm.shutdown()
    verdicts = {f"batch_{b}_equals_batch_{batches[0]}": runs[b] == first for b in batches[1:]}
    verdicts["prefill_recompute_equals_served"] = scored == first["logprobs"]
    result = {"preset": args.preset, "dtype": args.dtype, "tokens": tokens, "budget": args.budget,
              "platform": platform, "device": device,
              "target_prompt_tokens": len(target), "runs": {str(b): r for b, r in runs.items()},
              "recomputed_logprobs": scored, "verdicts": verdicts, "all_equal": all(verdicts.values())}
    print(json.dumps({"verdicts": verdicts, "all_equal": result["all_equal"]}), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
