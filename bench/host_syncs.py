"""Where the engine's decode steps make the host wait for the GPU, and what that costs, with
synchronous and asynchronous scheduling.

    python3 bench/host_syncs.py --out host_syncs.json                      # on the GPU
    python3 bench/host_syncs.py --smoke                                   # CPU: runs, finds nothing

Asynchronous scheduling should hide the host's work between decode steps behind the device's;
on k3-slice at one request it did not (TPOT 8.36 ms against 8.15 ms synchronous, BENCHMARKS.md).
A step that blocks on the device anywhere besides reading the running step's tokens would explain
it. With `torch.cuda.set_sync_debug_mode("warn")` torch warns at every synchronising call; this
records each call's stack (the k3 frames) and how often it happens per decode step, for a small
model (k3-tiny, where the host dominates a step, so any stall shows in the TPOT too) and
optionally k3-slice (`--preset k3-slice`). Random weights made on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from k3.checkpoint.writer import write_config
from k3.config import K3Config
from k3_slice import engine_for, prompt, sync
from k3.engine.params import SamplingParams


def _k3_frames(stack) -> str:
    """The innermost k3 frames of a stack, as 'file:line function' joined by ' <- '."""
    frames = [f for f in stack if "/k3/" in f.filename or "/core/" in f.filename or "/platforms/" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-6:]))


def measure(model_dir, platform, dtype, vocab, *, async_scheduling: bool, concurrency: int, steps: int) -> dict:
    engine = engine_for(model_dir, platform, max_num_seqs=max(concurrency, 1), max_model_len=512, dtype=dtype,
                        async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"s{i}", prompt(64, i, vocab), params)
    for _ in range(6):                               # prefill, graph warm-up
        engine.step()
    sync(engine)
    syncs: collections.Counter = collections.Counter()
    checking = engine.device.type == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning
        if checking:
            torch.cuda.set_sync_debug_mode("warn")

        def record(message, category, filename, lineno, file=None, line=None):
            syncs[f"{str(message)[:60]} @ {_k3_frames(traceback.extract_stack()[:-1])}"] += 1

        warnings.showwarning = record
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine)
        elapsed = time.perf_counter() - t0
        if checking:
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return {"async_scheduling": async_scheduling, "concurrency": concurrency, "steps": steps,
            "step_ms": 1e3 * elapsed / steps, "lookahead_steps": engine.num_lookahead_steps,
            "syncs_per_step": {k: v / steps for k, v in syncs.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="host_syncs.json")
    parser.add_argument("--platform", default="nvidia")
    parser.add_argument("--preset", nargs="+", default=["k3-tiny"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU reference platform, 4 steps")
    args = parser.parse_args()
    if args.smoke:
        args.platform, args.preset, args.concurrency, args.steps = "reference", ["k3-tiny"], [1], 4
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "runs": []}
    for preset in args.preset:
        cfg = K3Config.preset(preset)
        dtype = "float32" if args.smoke else "bfloat16"
        with tempfile.TemporaryDirectory() as model_dir:
            write_config(Path(model_dir), cfg)
            for concurrency in args.concurrency:
                for async_scheduling in (False, True):
                    run = measure(model_dir, args.platform, dtype, cfg.vocab_size, async_scheduling=async_scheduling,
                                  concurrency=concurrency, steps=args.steps)
                    run["preset"] = preset
                    result["runs"].append(run)
                    print(f"{preset} C={concurrency} async={async_scheduling}: {run['step_ms']:.2f} ms a step, "
                          f"{run['lookahead_steps']} lookaheads")
                    for where, n in run["syncs_per_step"].items():
                        print(f"  {n:5.2f}/step  {where}")
                    with open(args.out, "w") as f:
                        json.dump(result, f, indent=2)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
