"""Decode throughput with and without a JSON-schema constraint (issue 29), k3-tiny, CPU or GPU.

    python bench/structured_output.py [--batches 1,16,64 --tokens 32 --dtype float32 --validate]
        [--backend xgrammar|guidance] [--async-scheduling auto|on|off] [--speculative-config JSON]

For each batch size B: B free requests (sampled, EOS ignored, `--tokens` each) and B requests
constrained by a JSON schema (an array of at least `--tokens` digits, so none ends before
`--tokens` tokens), each on the same engine after a warm-up, all at once. Reported: generated
tokens/s of each and their ratio (the constraint's overhead: the host fills each row's
bitmask after launching the forward; the device unpacks and applies it). `--validate` also
runs the 200-request check of tests/unit/structured (20 schemas x 10 seeds: every output
validates with jsonschema and finishes with "stop"). `--smoke`: one small batch.

`--backend` picks the grammar backend (`guidance`: llguidance), `--async-scheduling` the
engine's scheduling (auto: on where decode graphs are captured without speculation), and
`--speculative-config` (vLLM's JSON, e.g. '{"method": "ngram", "num_speculative_tokens": 3}')
runs both kinds under speculative decoding, constrained requests drafted for and verified
against their grammar; the speculation counters of the timed runs are reported per batch.
`--validate` then also checks the 200 requests under that configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import k3
from k3.cli.checkpoint import init_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def rate(llm, params) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(["Numbers:"] * len(params), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, tokens


def spec_delta(before: dict, after: dict) -> dict:
    """Speculation counters between two snapshots: verify steps, drafted, accepted and
    grammar-refused tokens, and the accepted tokens per verify step."""
    keys = ("spec_verify_steps_total", "spec_draft_tokens_total", "spec_accepted_tokens_total",
            "spec_grammar_refused_drafts_total")
    d = {k.removeprefix("spec_").removesuffix("_total"): after[k] - before[k] for k in keys}
    d["accepted_per_verify"] = round(d["accepted_tokens"] / d["verify_steps"], 3) if d["verify_steps"] else 0.0
    return d


def validate(llm) -> dict:
    import jsonschema

    sys.path.insert(0, str(ROOT / "tests" / "unit" / "structured"))
    from test_structured_outputs import SCHEMAS

    params, schemas = [], []
    for i, schema in enumerate(SCHEMAS):
        for j in range(10):
            params.append(k3.SamplingParams(max_tokens=64, temperature=1.0, seed=100 * i + j,
                                            structured_outputs=k3.StructuredOutputsParams(json=schema)))
            schemas.append(schema)
    start = time.perf_counter()
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    ok = 0
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        try:
            jsonschema.validate(json.loads(c.text), schema)
            ok += c.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": len(params), "valid_and_stopped": ok, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per kind (the best is reported)")
    ap.add_argument("--backend", default="xgrammar", help="grammar backend: xgrammar, guidance (llguidance)")
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--speculative-config", default=None, metavar="JSON")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.repeats = 1
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    tokens = 8 if args.smoke else args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False)
        llm = k3.LLM(str(ckpt), dtype=args.dtype, load_progress=False, max_num_seqs=max(batches),
                     kv_cache_memory_gib=0.25, structured_outputs_backend=args.backend,
                     async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                     speculative_config=args.speculative_config)
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": tokens}
        so = k3.StructuredOutputsParams(json=schema)
        llm.engine.structured.compile(so)
        rows = []
        for b in batches:
            free = [k3.SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(b)]
            constrained = [k3.SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, structured_outputs=so)
                           for i in range(b)]
            # warm-up at this batch size for both kinds (on a GPU the first step of a new batch
            # size compiles kernels / captures graphs), then the best of `--repeats` timed runs
            rate(llm, free)
            rate(llm, constrained)
            before = llm.engine.spec_stats()
            free_rate, free_tokens = max(rate(llm, free) for _ in range(args.repeats))
            between = llm.engine.spec_stats()
            so_rate, so_tokens = max(rate(llm, constrained) for _ in range(args.repeats))
            rows.append({"batch": b, "free_tokens_per_s": round(free_rate, 1),
                         "constrained_tokens_per_s": round(so_rate, 1), "ratio": round(so_rate / free_rate, 3),
                         "free_tokens": free_tokens, "constrained_tokens": so_tokens})
            if before:
                rows[-1]["spec_free"] = spec_delta(before, between)
                rows[-1]["spec_constrained"] = spec_delta(between, llm.engine.spec_stats())
            print(json.dumps(rows[-1]), flush=True)
        result = {"preset": args.preset, "dtype": args.dtype, "device": str(llm.engine.device), "tokens": tokens,
                  "backend": args.backend, "async_scheduling": llm.engine.async_scheduling,
                  "speculative_config": args.speculative_config, "rows": rows}
        if args.validate:
            result["validate"] = validate(llm)
            print(json.dumps(result["validate"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
