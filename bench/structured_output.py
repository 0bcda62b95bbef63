"""Decode throughput with and without a JSON-schema constraint (issue 29), k3-tiny, CPU or GPU.

    python bench/structured_output.py [--batches 1,16,64 --tokens 32 --dtype float32 --validate]

For each batch size B: B free requests (sampled, EOS ignored, `--tokens` each) and B requests
constrained by a JSON schema (an array of at least `--tokens` digits, so none ends before
`--tokens` tokens), each on the same engine after a warm-up, all at once. Reported: generated
tokens/s of each and their ratio (the constraint's overhead: the host fills each row's
bitmask after launching the forward; the device unpacks and applies it). `--validate` also
runs the 200-request check of tests/unit/structured (20 schemas x 10 seeds: every output
validates with jsonschema and finishes with "stop"). `--smoke`: one small batch.
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
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
    tokens = 8 if args.smoke else args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False)
        llm = k3.LLM(str(ckpt), dtype=args.dtype, load_progress=False, max_num_seqs=max(batches),
                     kv_cache_memory_gib=0.25)
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": tokens}
        so = k3.StructuredOutputsParams(json=schema)
        llm.engine.structured.compile(so)
        rows = []
        for b in batches:
            free = [k3.SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(b)]
            constrained = [k3.SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, structured_outputs=so)
                           for i in range(b)]
            rate(llm, free[:1] + constrained[:1])                           # warm-up
            free_rate, free_tokens = rate(llm, free)
            so_rate, so_tokens = rate(llm, constrained)
            rows.append({"batch": b, "free_tokens_per_s": round(free_rate, 1),
                         "constrained_tokens_per_s": round(so_rate, 1), "ratio": round(so_rate / free_rate, 3),
                         "free_tokens": free_tokens, "constrained_tokens": so_tokens})
            print(json.dumps(rows[-1]), flush=True)
        result = {"preset": args.preset, "dtype": args.dtype, "device": str(llm.engine.device), "tokens": tokens,
                  "rows": rows}
        if args.validate:
            result["validate"] = validate(llm)
            print(json.dumps(result["validate"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
