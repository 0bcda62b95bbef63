"""End-to-end serving figures on k3-slice (12 layers of real K3 width, 128 MXFP4 experts top-16)
with random weights drawn on the GPU (`--load-format dummy`), through the offline engine.

    python3 bench/k3_slice.py --out k3_slice.json                       # nvidia, then the peer
    python3 bench/k3_slice.py --smoke                                   # CPU: k3-tiny, tiny sizes

For the platform measured (then, for decode at the smallest concurrency and the shortest TTFT
only, the peer on the same GPU: by default `ppu`, the torch-native path, i.e. the reference
ops on cuda):
  - decode: C concurrent requests (128-token prompts) each generating N tokens, greedy, EOS
    ignored; TPOT = decode time / steps and tokens/s = C * N / decode time, measured from the
    step after the last first token; C = 1, 4, 16, 64 by default; then the same with
    asynchronous scheduling (`decode_async`: each decode step launched before the previous
    one's tokens are read);
  - TTFT of one prompt of 1K, 8K and 32K tokens (alone in the engine, after a first prompt of
    the same length so compilation and autotuning stay out of it);
  - with prefix caching: TTFT of an 8K prompt sharing all but its last 64 tokens with an earlier
    request, against the same prompt with caching off;
  - with n-gram speculation (k = 3): decode tokens/s of one request with a repetitive prompt;
  - seed-notes' 8K-in / 1K-out workload scaled to one GPU (`--workload-requests`, default 8
    requests at once): output tokens/s, mean TTFT and TPOT.
Every phase runs on a fresh engine (random weights drawn again, same seed). K3_NVIDIA_EXPERIMENTAL
is passed through, so `K3_NVIDIA_EXPERIMENTAL=all` measures the experimental kernels too.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

from k3.checkpoint.writer import write_config
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams


def engine_for(model_dir, platform, *, max_num_seqs, max_model_len, dtype, **kw) -> LLMEngine:
    """An engine on random weights; synchronous scheduling unless kw says otherwise (the
    `decode_async` rows measure the served default where decode graphs are captured)."""
    kw.setdefault("async_scheduling", False)
    return LLMEngine(EngineConfig(model=model_dir, platform=platform, load_format="dummy", skip_tokenizer_init=True,
                                  dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=8192, load_progress=False, **kw))


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def prompt(n, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def decode(engine, concurrency, prompt_len, new_tokens, vocab) -> dict:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"d{concurrency}-{i}", prompt(prompt_len, i, vocab), params)
    started, steps, t0 = set(), 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()            # no device sync per step: it would stall asynchronous scheduling
        if t0 is not None:
            steps += 1
        for o in outs:
            if o.outputs[0].token_ids:
                started.add(o.request_id)
        if t0 is None and len(started) == concurrency:
            t0, produced = time.perf_counter(), 1        # every request has its first token
    sync(engine)
    elapsed = time.perf_counter() - t0
    tokens = concurrency * (new_tokens - produced)
    return {"concurrency": concurrency, "steps": steps, "tpot_ms": 1e3 * elapsed / max(steps, 1),
            "tokens_per_s": tokens / elapsed if elapsed else float("nan")}


def ttft(engine, ids, request_id) -> float:
    engine.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync(engine)
    return 1e3 * (time.perf_counter() - t0)


def release() -> None:
    """Give the GPU memory of an engine the caller has dropped (`engine = None`) back before the
    next one is built (two k3-slice engines do not fit on one GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def workload(model_dir, platform, args, vocab, max_model_len) -> dict:
    """seed-notes' serving workload scaled to one GPU: R requests of I prompt tokens and O output
    tokens, all arriving at once (greedy, EOS ignored), on a fresh engine: output tokens/s over
    the whole run, mean TTFT and mean TPOT per request."""
    r, n_in, n_out = args.workload_requests, args.workload_in, args.workload_out
    engine = engine_for(model_dir, platform, max_num_seqs=r, max_model_len=max(max_model_len, n_in + n_out + 64),
                        dtype=args.dtype)
    decode(engine, 1, 16, 4, vocab)                                       # warm-up (compilation)
    params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(r):
        engine.add_request(f"w{i}", prompt(n_in, 3000 + i, vocab), params)
    first, last = {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        sync(engine)
        now = time.perf_counter() - t0
        for o in outs:
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    elapsed = time.perf_counter() - t0
    engine = None
    release()
    ttfts = [first[k] for k in first]
    tpots = [(last[k] - first[k]) / max(n_out - 1, 1) for k in first]
    return {"requests": r, "input_tokens": n_in, "output_tokens": n_out, "seconds": elapsed,
            "output_tokens_per_s": r * n_out / elapsed, "total_tokens_per_s": r * (n_in + n_out) / elapsed,
            "mean_ttft_ms": 1e3 * sum(ttfts) / len(ttfts), "mean_tpot_ms": 1e3 * sum(tpots) / len(tpots)}


def measure(model_dir, platform, args, vocab, out: dict, save, *, full: bool = True) -> dict:
    """Every figure of the module docstring into `out`, calling save() after each phase so a run
    cut short by a time limit keeps what it measured; full=False (the peer): decode at the
    smallest concurrency and the shortest TTFT only (the reference path takes minutes for the rest, and its
MLA prefill materialises every head's keys: 24 GiB at 8K tokens)."""
    out["platform"] = platform
    if not full:
        args = argparse.Namespace(**{**vars(args), "concurrency": args.concurrency[:1], "ttft": sorted(args.ttft)[:1]})
    big = max(args.ttft + [args.prefix_len + 64, args.prompt_len + args.decode_tokens]) + 64
    engine = engine_for(model_dir, platform, max_num_seqs=max(args.concurrency), max_model_len=big, dtype=args.dtype)
    out["graph_buckets"] = engine.runner.graphs.buckets if engine.runner.graphs is not None else None
    out["graph_pool_bytes"] = getattr(engine.runner.graphs.runner, "pool_bytes", None) if engine.runner.graphs else None
    decode(engine, 1, 16, 4, vocab)                                       # warm-up (compilation)
    out["decode"], out["ttft_ms"] = [], {}
    for c in args.concurrency:
        out["decode"].append(decode(engine, c, args.prompt_len, args.decode_tokens, vocab))
        save(f"{platform} decode C={c}")
    for n in args.ttft:
        if full:        # a first prompt of the same length: kernels compiled and autotuned for its shapes
            ttft(engine, prompt(n, 2000 + n, vocab), f"warm{n}")
        out["ttft_ms"][str(n)] = ttft(engine, prompt(n, 1000 + n, vocab), f"t{n}")
        save(f"{platform} TTFT {n}")
    engine = None
    release()
    if not full or args.decode_only:
        return out
    # the same decode runs with asynchronous scheduling (the next step launched before this
    # one's tokens are read)
    engine = engine_for(model_dir, platform, max_num_seqs=max(args.concurrency), max_model_len=big, dtype=args.dtype,
                        async_scheduling=True)
    decode(engine, 1, 16, 4, vocab)
    out["decode_async"] = [decode(engine, c, args.prompt_len, args.decode_tokens, vocab) for c in args.concurrency]
    out["decode_async_lookahead_steps"] = engine.num_lookahead_steps
    save(f"{platform} decode with async scheduling")
    engine = None
    release()
    shared = prompt(args.prefix_len + 64, 7, vocab)
    for caching in (False, True):
        engine = engine_for(model_dir, platform, max_num_seqs=4, max_model_len=big, dtype=args.dtype,
                            enable_prefix_caching=caching)
        ttft(engine, shared[: args.prefix_len] + prompt(64, 8, vocab), "first")
        out[f"prefix_ttft_ms_caching_{'on' if caching else 'off'}"] = ttft(engine, shared, "second")
        save(f"{platform} prefix caching {caching}")
        engine = None
        release()
    if args.workload_requests:
        out["workload"] = workload(model_dir, platform, args, vocab, big)
        save(f"{platform} workload")
    repetitive = (prompt(16, 9, vocab) * 16)[: args.prompt_len]
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        engine = engine_for(model_dir, platform, max_num_seqs=1, max_model_len=big, dtype=args.dtype,
                            speculative_config=spec)
        engine.add_request("s", repetitive, SamplingParams(max_tokens=args.decode_tokens, temperature=0,
                                                          ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        sync(engine)
        out[f"single_decode_tokens_per_s_{'ngram' if spec else 'plain'}"] = \
            args.decode_tokens / (time.perf_counter() - t0)
        save(f"{platform} speculation {bool(spec)}")
        engine = None
        release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="k3_slice.json")
    parser.add_argument("--platform", default="nvidia")
    parser.add_argument("--peer", default="ppu", help="peer platform on the same device ('' for none)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--ttft", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--prefix-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workload-requests", type=int, default=8,
                        help="seed-notes' 8K-in / 1K-out workload, scaled: this many requests at once (0: skip)")
    parser.add_argument("--workload-in", type=int, default=8192)
    parser.add_argument("--workload-out", type=int, default=1024)
    parser.add_argument("--decode-only", action="store_true",
                        help="synchronous decode at --concurrency and TTFT at --ttft only (an A/B of a decode kernel)")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU reference platform, tiny sizes")
    args = parser.parse_args()
    preset = "k3-slice"
    if args.smoke:
        preset, args.platform, args.peer, args.dtype = "k3-tiny", "reference", "ppu", "float32"
        args.concurrency, args.decode_tokens, args.prompt_len, args.ttft, args.prefix_len = [1, 3], 6, 24, [40], 64
        args.workload_requests, args.workload_in, args.workload_out = 2, 40, 6
    cfg = K3Config.preset(preset)
    result = {"date": datetime.date.today().isoformat(), "preset": preset, "torch": torch.__version__,
              "experimental": os.environ.get("K3_NVIDIA_EXPERIMENTAL", ""),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    started = time.perf_counter()

    def save(phase: str) -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"[{time.perf_counter() - started:7.1f} s] {phase}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as model_dir:
        write_config(__import__("pathlib").Path(model_dir), cfg)
        for platform in [args.platform] + ([args.peer] if args.peer else []):
            result[platform] = {}
            try:
                measure(model_dir, platform, args, cfg.vocab_size, result[platform], save,
                        full=platform == args.platform)
            except Exception as e:  # report, don't hide
                traceback.print_exc()
                result[platform]["error"] = f"{type(e).__name__}: {e}"
            save(f"{platform} done")
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
