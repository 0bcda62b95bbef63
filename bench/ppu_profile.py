"""Where the ppu platform's time goes on k3-slice (issue 26): device time per kernel name and per
calling k3 module, under torch.profiler, for a few decode steps at 1 and at 64 requests and for
one 8K-token prefill, all from one engine in one device call.

    python3 bench/ppu_profile.py --out ppu_profile.json        # CUDA (the H200 stand-in): k3-slice
    python3 bench/ppu_profile.py --no-compile --out eager.json  # what a PPU runs: nothing compiled
    python3 bench/ppu_profile.py --smoke --out s.json           # CPU: k3-tiny (the script check)

The engine is `--platform ppu` with its defaults (the expert cache `auto`, entries compiled
where torch.compile can target the device) run eagerly (`enforce_eager`: the kernels a decode
graph replays, each its own record). Each section lists the kernels by device time per step
(`kernels`: name, microseconds and calls a step) and the top-level torch ops by the module that
launched them (`stacks`), with the profiled step's wall time; the tables are k3_slice_profile's.
What to read: in `decode_1` the two `_grouped_mm` kernels of each MoE layer against the 1.06 GB
of bf16 experts they read (0.26 ms at 4 TB/s), in `decode_64` whatever is not a GEMM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from k3.checkpoint.writer import write_config
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3_slice_profile import annotate_modules, kernel_table, remove_annotations, stack_table


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profiled(engine, device: str, steps: int, top: int) -> dict:
    """`steps` engine steps under the profiler: the kernel and module tables, the wall time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    annotated = annotate_modules(engine.model)
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        step_ms = 1e3 * (time.perf_counter() - t0) / steps
    remove_annotations(annotated)
    rows = kernel_table(prof, steps, device)
    return {"steps": steps, "eager_step_ms_under_profiler": step_ms,
            "kernel_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows[:top],
            "stacks": stack_table(prof, steps, top, device)}


def decode_section(engine, device: str, concurrency: int, steps: int, prompt_len: int, top: int, vocab: int) -> dict:
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}", prompt(prompt_len, i, vocab), params)
    for _ in range(3):                  # prefill (one step within the token budget), then warm decode steps
        engine.step()
    section = {"concurrency": concurrency, **profiled(engine, device, steps, top)}
    while engine.has_unfinished_requests():
        engine.step()
    return section


def prefill_section(engine, device: str, tokens: int, top: int, vocab: int) -> dict:
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompt(tokens, 99, vocab), once)     # compiles / allocates this length first
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("p", prompt(tokens, 1, vocab), once)
    section = {"prefill_tokens": tokens, **profiled(engine, device, 1, top)}
    while engine.has_unfinished_requests():
        engine.step()
    return section


def report(name: str, section: dict, top: int) -> None:
    print(f"== {name}: eager step {section['eager_step_ms_under_profiler']:.2f} ms under the profiler, device time "
          f"{section['kernel_us_per_step'] / 1e3:.2f} ms a step")
    for r in section["kernels"][:top]:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['kernel'][:110]}")
    print("  by calling module:")
    for r in section["stacks"][:top]:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['op']:28s} <- {r['module']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ppu_profile.json")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=4, help="decode steps profiled at each concurrency")
    parser.add_argument("--prefill", type=int, default=8192, help="tokens of the profiled prefill (0: none)")
    parser.add_argument("--top", type=int, default=30, help="rows kept and printed per table")
    parser.add_argument("--expert-cache", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--no-compile", action="store_true", help="K3_TORCH_COMPILE=0: nothing compiled")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--smoke", action="store_true",
                        help="k3-tiny on the CPU: one step of two requests, a 16-token prefill")
    args = parser.parse_args()
    if args.no_compile:
        os.environ["K3_TORCH_COMPILE"] = "0"
    preset, dtype = ("k3-tiny", "float32") if args.smoke else ("k3-slice", "bfloat16")
    if args.smoke:
        args.concurrency, args.steps, args.prefill = [2], 1, 16
    cfg = K3Config.preset(preset)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(Path(model_dir), cfg)
        engine = LLMEngine(EngineConfig(
            model=model_dir, platform="ppu", load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
            max_num_seqs=max(args.concurrency), max_model_len=max(args.prefill, 64) + 256,
            max_num_batched_tokens=max(args.prefill, 2048), load_progress=False, async_scheduling=False,
            enforce_eager=True, kv_cache_memory_gib=0.05 if args.smoke else None, expert_cache=args.expert_cache,
            gpu_memory_utilization=args.gpu_memory_utilization))
        decision = engine.expert_cache
        result = {"date": datetime.date.today().isoformat(), "preset": preset, "platform": "ppu",
                  "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                  "compiled_entries": os.environ.get("K3_TORCH_COMPILE", "1") != "0",
                  "expert_cache": {"on": decision.on, "reason": decision.reason}}
        for c in args.concurrency:
            result[f"decode_{c}"] = decode_section(engine, device, c, args.steps, 64, args.top, cfg.vocab_size)
            report(f"decode at {c} requests", result[f"decode_{c}"], args.top)
            Path(args.out).write_text(json.dumps(result, indent=2))
        if args.prefill:
            result[f"prefill_{args.prefill}"] = prefill_section(engine, device, args.prefill, args.top, cfg.vocab_size)
            report(f"prefill of {args.prefill} tokens", result[f"prefill_{args.prefill}"], args.top)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"expert cache: {result['expert_cache']}; written {args.out}")


if __name__ == "__main__":
    main()
