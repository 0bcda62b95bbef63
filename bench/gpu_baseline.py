"""GPU baseline in one call: the device's ceilings, then k3's reference KDA ops against
fla-core's kernels (the peer) at K3 per-layer shapes (96 heads x 128, one GPU, bf16 inputs,
fp32 state), plus the reference absorbed-MLA decode.

    python3 bench/gpu_baseline.py --out baseline.json

Prints a table and writes every number (with the device, torch/triton/fla versions and the
date) to --out. Correctness first: each peer is compared with the reference on the same fresh
random inputs (error ratio RMS(a - b) / RMS(b)); timings are medians of CUDA-event timings
after warm-up (triton.testing.do_bench). These are baselines for the NVIDIA kernels issue.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math

import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked as torch_chunked  # the reference platform's kernel
from k3.platforms.torch_kernels import kda_recurrent as torch_recurrent  # the reference platform's kernel
from k3.platforms.torch_kernels import mla_decode as torch_mla  # the reference platform's kernel
from measure import bench_ms, copy_bandwidth_GBps, ratio


def bench(fn, *, rep_ms: int = 200) -> float:
    return bench_ms(fn, rep_ms)


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ b)
    return {"copy_GBps": copy_bandwidth_GBps(rep_ms=200), "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


def kda_inputs(b: int, t: int, h: int, d: int, *, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q = ref.l2_norm(rnd(b, t, h, d)).bfloat16()
    k = ref.l2_norm(rnd(b, t, h, d)).bfloat16()
    v = rnd(b, t, h, d).bfloat16()
    gate = ref.kda_gate(rnd(b, t, h, d), torch.rand(h, device="cuda", generator=g) * 2,
                        0.5 * rnd(h * d), lower_bound=-5.0)          # fp32 log decay in (-5, 0)
    beta = torch.sigmoid(rnd(b, t, h))
    s0 = 0.1 * rnd(b, h, d, d)
    return q, k, v, gate, beta, s0


def kda_prefill(ceil: dict, t: int = 8192, h: int = 96, d: int = 128) -> dict:
    q, k, v, g, beta, s0 = kda_inputs(1, t, h, d, seed=0)
    out = {"shape": f"B1 T{t} H{h} K=V{d}"}
    want = torch_chunked.kda_chunked(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = want.o, want.state
    out["reference_ms"] = bench(lambda: torch_chunked.kda_chunked(q, k, v, g, beta, initial_state=s0), rep_ms=2000)
    try:
        from fla.ops.kda import chunk_kda

        o_fla, s_fla = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        out["fla_chunk_kda_ms"] = bench(lambda: chunk_kda(q, k, v, g, beta, initial_state=s0,
                                                          output_final_state=True))
        out["fla_vs_reference_error_ratio"] = {"o": ratio(o_fla, o_ref), "state": ratio(s_fla, s_ref)}
    except Exception as e:  # report, don't hide
        out["fla_error"] = f"{type(e).__name__}: {e}"
    # bytes: q, k, v (bf16), g (fp32), beta, o (bf16), states in and out (fp32)
    nbytes = t * h * d * (2 * 3 + 4 + 2) + t * h * 4 + 2 * h * d * d * 4
    out["min_bytes"] = nbytes
    out["floor_ms"] = nbytes / ceil["copy_GBps"] / 1e6
    return out


def kda_decode(ceil: dict, n: int = 64, h: int = 96, d: int = 128) -> dict:
    q, k, v, g, beta, s0 = kda_inputs(n, 1, h, d, seed=1)
    out = {"shape": f"N{n} T1 H{h} K=V{d}"}
    want = torch_recurrent.kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_ref, s_ref = want.o, want.state
    out["reference_ms"] = bench(lambda: torch_recurrent.kda_recurrent(q, k, v, g, beta, initial_state=s0))
    try:
        from fla.ops.kda import fused_recurrent_kda

        o_fla, s_fla = fused_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        out["fla_fused_recurrent_ms"] = bench(lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=s0,
                                                                          output_final_state=True))
        out["fla_vs_reference_error_ratio"] = {"o": ratio(o_fla, o_ref), "state": ratio(s_fla, s_ref)}
    except Exception as e:
        out["fla_error"] = f"{type(e).__name__}: {e}"
    nbytes = 2 * n * h * d * d * 4 + n * h * d * (2 * 4 + 4)      # states in + out dominate
    out["min_bytes"] = nbytes
    out["floor_ms"] = nbytes / ceil["copy_GBps"] / 1e6
    return out


def mla_decode(ceil: dict, n: int = 64, context: int = 8192, h: int = 96) -> dict:
    r, dr, dn, dv, page = 512, 64, 128, 128, 64
    pages = n * math.ceil(context / page)
    gen = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.randn(pages, page, r + dr, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(pages, device="cuda", generator=gen).view(n, -1).int()
    seq_lens = torch.full((n,), context, device="cuda")
    q_nope = torch.randn(n, h, dn, device="cuda", generator=gen).bfloat16()
    q_pe = torch.randn(n, h, dr, device="cuda", generator=gen).bfloat16()
    w_uk = (torch.randn(h, dn, r, device="cuda", generator=gen) / r ** 0.5).bfloat16()
    w_uv = (torch.randn(h, r, dv, device="cuda", generator=gen) / r ** 0.5).bfloat16()
    call = lambda: torch_mla.mla_decode(q_nope, q_pe, cache, table, seq_lens, w_uk, w_uv, scale=192 ** -0.5)  # noqa: E731
    ms = bench(call)
    nbytes = n * context * (r + dr) * 2
    return {"shape": f"N{n} context {context} H{h} latent {r}+{dr} bf16", "reference_ms": ms, "min_bytes": nbytes,
            "floor_ms": nbytes / ceil["copy_GBps"] / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_baseline.json")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    result = {"date": datetime.date.today().isoformat(), "device": props.name, "torch": torch.__version__}
    try:
        import triton

        result["triton"] = triton.__version__
        import fla

        result["fla"] = getattr(fla, "__version__", "unknown")
    except ImportError as e:
        result["import_error"] = str(e)
    result["ceilings"] = ceil = ceilings()
    for name, fn in (("kda_prefill", kda_prefill), ("kda_decode", kda_decode), ("mla_decode", mla_decode)):
        try:
            result[name] = fn(ceil)
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
