"""Where a k3-slice decode step's time goes: device time per kernel, grouped by name, for decode
steps at one concurrency under torch.profiler, in one call on the GPU.

    python3 bench/k3_slice_profile.py --out k3_slice_profile.json            # nvidia, C = 1
    python3 bench/k3_slice_profile.py --prefill 8192 --out prefill.json      # one 8K prompt's prefill
    python3 bench/k3_slice_profile.py --smoke                                # CPU: k3-tiny

The engine runs eagerly (`enforce_eager`: the same kernels a CUDA graph replays, launched one
by one, so each has its own record); the table lists the kernels by total device time over the
profiled steps, with calls per step and microseconds per step, and the sum against the measured
step time, so the TPOT gap to the bytes roofline (BENCHMARKS.md, NVIDIA kernels issue) can be
placed on kernels. K3_NVIDIA_EXPERIMENTAL passes through.

Two more views of the same steps: `stacks`, the device time of each torch op grouped by the k3
module that called it (which part of which layer launches the copies and elementwise kernels;
every submodule's forward is a profiler range while profiling), and
`host` (with --graph), the engine with CUDA-graph decode as it serves, under cProfile: the wall
time per step against the device time, and the Python functions that take the rest.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import datetime
import gc
import io
import json
import os
import pstats
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3.checkpoint.writer import write_config
from k3.config import K3Config
from k3.engine.params import SamplingParams
from k3_slice import engine_for, prompt, sync


def _top_level_aten(event) -> bool:
    """An aten op not called by another aten op (its parents may be Python frames)."""
    return event.name.startswith("aten::") and not (event.cpu_parent is not None
                                                    and event.cpu_parent.name.startswith("aten::"))


def kernel_table(prof, steps: int, device: str) -> list[dict]:
    """Device time per kernel name over the profiled steps, largest first."""
    totals, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if device == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            duration = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0)
        elif _top_level_aten(event):              # CPU: top-level aten ops stand in for kernels
            duration = event.cpu_time
        else:
            continue
        totals[event.name] += duration
        calls[event.name] += 1
    return [{"kernel": name, "us_per_step": total / steps, "calls_per_step": calls[name] / steps}
            for name, total in totals.most_common()]


MODULE_PREFIX = "k3::"


def annotate_modules(model) -> list:
    """Run every submodule's forward inside a profiler range named after it
    ("k3::model.layers.*.mlp", layer numbers folded into *), so each op's innermost module can be
    read off its parents in the profile: ranges are CPU events on every torch version, with or
    without CUDA activity (torch's Python-frame events, `with_stack`, did not reach the ops on the
    H200, and with these ranges they corrupt event names on the CPU now and then).
    Returns the modules whose forward was wrapped (`remove_annotations` restores them)."""
    wrapped = []
    for name, module in model.named_modules():
        if not name:
            continue
        label = MODULE_PREFIX + ".".join("*" if part.isdigit() else part for part in name.split("."))

        def forward(*args, _forward=module.forward, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _forward(*args, **kwargs)

        module.forward = forward
        wrapped.append(module)
    return wrapped


def remove_annotations(modules: list) -> None:
    for module in modules:
        del module.forward                            # the instance attribute: the class's forward again


def _calling_module(event) -> str:
    """The innermost annotated k3 module above a profiler event (`annotate_modules`), or "?"."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(MODULE_PREFIX):
            return parent.name[len(MODULE_PREFIX):]
        parent = parent.cpu_parent
    return "?"


def stack_table(prof, steps: int, rows: int, device: str) -> list[dict]:
    """Time of the top-level torch ops (device time on the GPU, CPU time on the CPU), grouped by
    op name and the k3 module that called it: which part of which layer launches the copies and
    the elementwise kernels."""
    totals, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if not _top_level_aten(event):
            continue
        spent = (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)) \
            if device == "cuda" else event.cpu_time_total
        key = (event.name, _calling_module(event))
        totals[key] += spent
        calls[key] += 1
    return [{"op": op, "module": where, "us_per_step": total / steps, "calls_per_step": calls[(op, where)] / steps}
            for (op, where), total in totals.most_common(rows)]


def host_profile(model_dir, platform, concurrency, steps, dtype, vocab) -> dict:
    """Graph-mode decode steps under cProfile: wall ms per step and the top functions."""
    engine = engine_for(model_dir, platform, max_num_seqs=max(concurrency, 1), max_model_len=512, dtype=dtype)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"h{i}", prompt(64, i, vocab), params)
    for _ in range(4):
        engine.step()
    sync(engine)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync(engine)
    profiler.disable()
    step_ms = 1e3 * (time.perf_counter() - t0) / steps
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    return {"graph_step_ms_under_cprofile": step_ms, "cprofile_top": text.getvalue()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="k3_slice_profile.json")
    parser.add_argument("--platform", default="nvidia")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=40, help="kernels printed")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU reference platform")
    parser.add_argument("--graph", action="store_true", help="also profile the host side of graph-mode steps")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="profile the prefill of one prompt of this many tokens (after a first prompt of the "
                             "same length) instead of decode steps")
    args = parser.parse_args()
    preset, dtype = ("k3-tiny", "float32") if args.smoke else ("k3-slice", "bfloat16")
    if args.smoke:
        args.platform, args.steps = "reference", 2
    cfg = K3Config.preset(preset)
    with tempfile.TemporaryDirectory() as model_dir:
        write_config(__import__("pathlib").Path(model_dir), cfg)
        engine = engine_for(model_dir, args.platform, max_num_seqs=max(args.concurrency, 1),
                            max_model_len=max(512, args.prefill + 64), dtype=dtype, enforce_eager=True)
        device = engine.device.type
        if args.prefill:                            # a first prompt of the same length compiles its shapes
            once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            engine.add_request("warm", prompt(args.prefill, 99, cfg.vocab_size), once)
            while engine.has_unfinished_requests():
                engine.step()
            engine.add_request("p", prompt(args.prefill, 1, cfg.vocab_size), once)
        else:
            params = SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
            for i in range(args.concurrency):
                engine.add_request(f"p{i}", prompt(64, i, cfg.vocab_size), params)
            for _ in range(3):                      # prefill, then warm decode steps (compilation)
                engine.step()
        sync(engine)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        annotated = annotate_modules(engine.model)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            if args.prefill:                        # the prompt's prefill steps (one within the token budget)
                args.steps = 0
                while engine.has_unfinished_requests():
                    engine.step()
                    args.steps += 1
            else:
                for _ in range(args.steps):
                    engine.step()
            sync(engine)
            step_ms = 1e3 * (time.perf_counter() - t0) / args.steps
        remove_annotations(annotated)
        engine = annotated = None               # the graph-mode engine below allocates its own cache:
        gc.collect()                            # the first one's (~77 GiB at k3-slice) must be gone
        if device == "cuda":
            torch.cuda.empty_cache()
        host = (host_profile(model_dir, args.platform, args.concurrency, args.steps * 4, dtype, cfg.vocab_size)
                if args.graph else None)
    rows = kernel_table(prof, args.steps, device)
    stacks = stack_table(prof, args.steps, args.top, device)
    result = {"date": datetime.date.today().isoformat(), "preset": preset, "platform": args.platform,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "experimental": os.environ.get("K3_NVIDIA_EXPERIMENTAL", ""), "concurrency": args.concurrency,
              "prefill_tokens": args.prefill, "steps": args.steps,
              "eager_step_ms_under_profiler": step_ms,
              "kernel_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows, "stacks": stacks,
              "host": host}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    what = f"prefill of {args.prefill} tokens ({args.steps} steps)" if args.prefill else f"C={args.concurrency}"
    print(f"{preset} on {args.platform}, {what}: eager step {step_ms:.2f} ms under the profiler, "
          f"device time {result['kernel_us_per_step'] / 1e3:.2f} ms per step")
    for r in rows[: args.top]:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['kernel'][:110]}")
    print("device time by calling module:")
    for r in stacks:
        print(f"{r['us_per_step']:10.1f} us {r['calls_per_step']:6.1f}x  {r['op']:28s} <- {r['module']}")
    if host:
        print(f"graph-mode step: {host['graph_step_ms_under_cprofile']:.2f} ms under cProfile")
        print(host["cprofile_top"])


if __name__ == "__main__":
    main()
