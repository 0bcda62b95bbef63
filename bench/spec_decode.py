"""Decode speed with and without speculative decoding (k3-tiny, random weights, CPU or GPU).

    python bench/spec_decode.py [--tokens 64 --repeats 3 --preset k3-tiny]
    python bench/spec_decode.py --preset k3-tiny-mtp        # adds the checkpoint's MTP layer ("mtp")

One request, greedy, a repetitive prompt (so n-gram lookup has something to match). Variants,
each on a fresh engine in the same run: plain decoding (the peer), n-gram k=3 with each KDA
rollback, a draft model identical to the target (every draft accepted: the upper bound of
what a perfect draft buys at this size, and the verify overhead), and with a preset that has
MTP layers the "mtp" method (its random MTP layer rarely agrees with the target: the figure is
its draft + verify overhead). Reported: decode tokens/s
(tokens after the first / time after the first), mean acceptance length (tokens per verify
step), and whether the output equals plain decoding (it must). Acceptance on random weights
says nothing about a trained model (DESIGN.md "Testing equality"); the figure that counts
here is the exactness and the cost of a verify step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from k3.cli.checkpoint import init_checkpoint
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


def decode_rate(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    first = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs[0].token_ids:
                first = (time.perf_counter(), len(o.outputs[0].token_ids))
            out = o
    end = time.perf_counter()
    ids = out.outputs[0].token_ids
    return (len(ids) - first[1]) / (end - first[0]), ids


def release(engine) -> None:
    """Free an engine's cache before the next one plans its own: on an accelerator each engine
    plans what the weights leave (gpu_memory_utilization), so two alive at once do not fit."""
    import gc

    import torch

    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="k3-tiny")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ckpt = str(init_checkpoint(args.preset, tempfile.mkdtemp(prefix="k3-bench-"), progress=False))
    prompt = [11, 42, 97, 230, 5, 61, 300, 17] * 16
    variants = {
        "plain": None,
        "ngram_k3_states": {"method": "ngram", "num_speculative_tokens": 3, "kda_rollback": "states"},
        "ngram_k3_recover": {"method": "ngram", "num_speculative_tokens": 3, "kda_rollback": "recover"},
        "identical_draft_k3": {"method": "draft_model", "model": ckpt, "num_speculative_tokens": 3},
    }
    if K3Config.from_pretrained(ckpt).num_nextn_predict_layers:
        variants["mtp_k3"] = {"method": "mtp", "num_speculative_tokens": 3}
    rates = {name: [] for name in variants}
    results = {}
    for _ in range(args.repeats):
        for name, spec in variants.items():
            engine = LLMEngine(EngineConfig(model=ckpt, load_progress=False, kv_cache_memory_gib=0.25, max_num_seqs=4,
                                            speculative_config=spec))
            rate, ids = decode_rate(engine, prompt, args.tokens)
            rates[name].append(rate)
            stats = engine.spec_stats() if spec else {}
            results[name] = {"mean_acceptance_length": round(stats.get("spec_mean_acceptance_length", 1.0), 3),
                             "ids": ids}
            release(engine)
            del engine
    plain = statistics.median(rates["plain"])
    table = {}
    for name in variants:
        rate = statistics.median(rates[name])
        accept = results[name]["mean_acceptance_length"]
        table[name] = {"decode_tokens_per_s": round(rate, 1), "vs_plain": round(rate / plain, 2),
                       "mean_acceptance_length": accept,
                       # one engine step (propose + verify 1 + k tokens) against one plain decode step
                       "step_time_vs_plain_step": round(accept / rate * plain, 2),
                       "output_equals_plain": results[name]["ids"] == results["plain"]["ids"]}
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"model": f"{args.preset} (bf16, random weights)", "device": device, "generated_tokens": args.tokens,
                      "prompt_tokens": len(prompt), "repeats": args.repeats, "variants": table,
                      "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
