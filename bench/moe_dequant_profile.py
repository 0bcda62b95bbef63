"""Where the MXFP4 MoE "dequant" mode's time goes at prefill sizes, kernel by kernel (torch
profiler, CUDA time), at k3-slice's expert dimensions: the grouped dequantise launches, the
grouped bf16 products, the activation, gathers and the weighted sum.

    python3 bench/moe_dequant_profile.py --out moe_dequant_profile.json [--tokens 1024 8192]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from moe_mxfp4 import SITU_BETA, make_experts, make_tokens

from k3.platforms.triton_kernels import moe_mxfp4_dequant as dequant

E, TOPK, L, I = 128, 16, 3584, 3072


def profile(tokens, w13, w2):
    dev = w13.packed.device
    x, weights, ids = make_tokens(tokens, E, L, TOPK, dev, seed=tokens)
    call = lambda: dequant.experts_forward(x, w13, w2, weights, ids, activation="situ", beta=SITU_BETA)   # noqa: E731
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if cuda_us:
            rows.append({"name": evt.key[:90], "calls": evt.count, "cuda_ms": cuda_us / 1e3})
    rows.sort(key=lambda r: -r["cuda_ms"])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return {"wall_ms": start.elapsed_time(end), "grouped_mm": dequant.grouped_mm_runs(dev, torch.bfloat16),
            "kernels": rows[:25]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_dequant_profile.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    args = parser.parse_args()
    w13, w2 = make_experts(E, I, L, torch.device("cuda"), seed=0)
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    for t in args.tokens:
        result[f"T{t}"] = profile(t, w13, w2)
        print(f"T={t}: {result[f'T{t}']['wall_ms']:.1f} ms, grouped_mm {result[f'T{t}']['grouped_mm']}")
        for r in result[f"T{t}"]["kernels"][:12]:
            print(f"  {r['cuda_ms']:9.2f} ms {r['calls']:5d}  {r['name']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
