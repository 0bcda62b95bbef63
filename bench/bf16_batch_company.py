"""Greedy outputs alone vs in a crowd (issue 32 item 1): the engine-level figure of batch company.

    python bench/bf16_batch_company.py --out bf16_batch_company.json                   # nvidia, k3-slice
    python bench/bf16_batch_company.py --smoke --out /tmp/company.json                # CPU: k3-tiny, tiny sizes

For each configuration, a fresh `k3.LLM` on random weights (`load_format="dummy"`, the same seed)
generates `--tokens` greedy tokens (EOS ignored, logprobs=2) for `--prompts` prompts one at a time
(alone), then for the same prompts among `--others` other prompts in one `generate` call (the
crowd: other batch sizes, other positions in the batch, prefill chunks mixed with decodes). Odd
prompts share a 12-token prefix. Per configuration it records how many prompts' tokens differ,
and for each the step of the first difference and the lone run's top-two log-prob gap there;
every gap must be within bf16's batch-company margin (conformance's `model.batch_invariance`,
2.0) for the kernels to pass: a split at a wider gap means a variant rounds elsewhere.

Configurations (`--dtypes`, `--kernels`, `--rounding`, `--settings`, all crossed):
  - dtype bfloat16 / float32;
  - kernels "served" (the platform's defaults) or "no_moe" (K3_NVIDIA_DISABLE=moe_experts: the
    routed experts on the reference ops, as the issue's run measured);
  - rounding "after" (this tree) or "before" (K3_LEGACY_ROUNDING=1: the variants as they rounded
    before issue 32, so one device run records both);
  - setting "plain" (no prefix caching), "prefix_caching", "ngram" (n-gram speculation, k = 3).
Writes the JSON to --out and prints one line per configuration.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

MARGIN = 2.0             # conformance's bf16 batch-company margin (k3.conformance.cases.model.MARGINS)
SETTINGS = {"plain": {"enable_prefix_caching": False},
            "prefix_caching": {"enable_prefix_caching": True},
            "ngram": {"enable_prefix_caching": False,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
            # the exact mode: a prompt's tokens must not move with its company at all (0 splits)
            "batch_invariant": {"enable_prefix_caching": False, "batch_invariant": True}}
KERNELS = {"served": "", "no_moe": "moe_experts"}


def prompts(vocab: int, count: int, seed: int = 32) -> list[list[int]]:
    """`count` random prompts of 4-28 tokens; odd ones after a shared 12-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(12)]
    own = [[rng.randrange(10, vocab) for _ in range(rng.randrange(4, 28))] for _ in range(count)]
    return [shared + p if i % 2 else p for i, p in enumerate(own)]


def first_divergence(alone, crowded) -> dict | None:
    """{step, gap} of the first differing token (gap: the lone run's top-two log-prob gap
    there), or None when the tokens are equal."""
    a, c = alone.outputs[0], crowded.outputs[0]
    for step, (x, y) in enumerate(zip(a.token_ids, c.token_ids)):
        if x != y:
            best = sorted(a.logprobs[step].values(), reverse=True)
            return {"step": step, "gap": round(best[0] - best[1], 4)}
    return None


def median_top_two_gap(outputs) -> float | None:
    """The median top-two log-prob gap over every step of the lone runs: the scale of the
    margin's context (random weights with a std-1 lm_head give logit std ~ sqrt(hidden), so a
    wide model's typical gap is far above k3-tiny's)."""
    gaps = sorted(best[0] - best[1] for out in outputs for step in out.outputs[0].logprobs
                  if len(best := sorted(step.values(), reverse=True)) > 1)
    return round(gaps[len(gaps) // 2], 4) if gaps else None


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(model_dir: str, args, *, dtype: str, kernels: str, rounding: str, setting: str, vocab: int) -> dict:
    import k3

    env = {"K3_NVIDIA_DISABLE": KERNELS[kernels], "K3_LEGACY_ROUNDING": "1" if rounding == "before" else "0"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    started = time.perf_counter()
    llm = None
    try:
        llm = k3.LLM(model_dir, platform=args.platform, dtype=dtype, load_format="dummy", skip_tokenizer_init=True,
                     load_progress=False, max_num_seqs=args.prompts + args.others,
                     gpu_memory_utilization=args.gpu_memory_utilization, **SETTINGS[setting])
        every = prompts(vocab, args.prompts + args.others)
        params = k3.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=2)
        as_inputs = lambda ps: [{"prompt_token_ids": p} for p in ps]  # noqa: E731
        alone = [llm.generate(as_inputs([p]), params, use_tqdm=False)[0] for p in every[: args.prompts]]
        crowded = llm.generate(as_inputs(every), params, use_tqdm=False)[: args.prompts]
        splits = {i: d for i, (a, c) in enumerate(zip(alone, crowded)) if (d := first_divergence(a, c))}
    finally:
        del llm                    # also after an error: the next configuration needs the memory
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        release()
    gaps = [d["gap"] for d in splits.values()]
    return {"dtype": dtype, "kernels": kernels, "rounding": rounding, "setting": setting,
            "differing": len(splits), "of": args.prompts, "max_gap": max(gaps, default=None),
            "median_lone_gap": median_top_two_gap(alone),
            "above_margin": sum(g > MARGIN for g in gaps), "splits": splits,
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bf16_batch_company.json")
    parser.add_argument("--platform", default="nvidia")
    parser.add_argument("--preset", default="k3-slice")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--others", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--kernels", nargs="+", default=["served", "no_moe"], choices=list(KERNELS))
    parser.add_argument("--rounding", nargs="+", default=["after", "before"], choices=["after", "before"])
    parser.add_argument("--settings", nargs="+", default=["plain"], choices=list(SETTINGS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                        help="below the engine's 0.9: float32 k3-slice's weights leave the plan less room")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU reference platform, tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        args.platform, args.preset, args.prompts, args.others, args.tokens = "reference", "k3-tiny", 3, 4, 6
        args.dtypes, args.kernels = ["bfloat16"], ["served"]

    from k3.checkpoint.writer import write_config
    from k3.config import K3Config

    cfg = K3Config.preset(args.preset)
    result = {"date": datetime.date.today().isoformat(), "platform": args.platform, "preset": args.preset,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "prompts": args.prompts, "others": args.others, "tokens": args.tokens,
              "margin": MARGIN, "runs": []}
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(Path(model_dir), cfg)
        for setting in args.settings:
            for dtype in args.dtypes:
                for kernels in args.kernels:
                    for rounding in args.rounding:
                        try:
                            run = measure(model_dir, args, dtype=dtype, kernels=kernels, rounding=rounding,
                                          setting=setting, vocab=cfg.vocab_size)
                        except Exception as e:  # report, don't hide
                            run = {"dtype": dtype, "kernels": kernels, "rounding": rounding, "setting": setting,
                                   "error": f"{type(e).__name__}: {e}"}
                        result["runs"].append(run)
                        print(json.dumps({k: v for k, v in run.items() if k != "splits"}), flush=True)
                        with open(args.out, "w") as f:
                            json.dump(result, f, indent=2)
    failed = [r for r in result["runs"] if "error" in r or (r["rounding"] == "after" and r["above_margin"])]
    print(f"{len(result['runs'])} configurations, {len(failed)} with an error or a split above the margin "
          f"{MARGIN} in this tree's rounding", file=sys.stderr)


if __name__ == "__main__":
    main()
