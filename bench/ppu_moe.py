"""The routed-experts microbenchmark of bench/ppu_backend.py (issue 26): `moe.experts` of one
k3-slice layer (128 experts, top-16) at T = 1 / 16 / 64 / 1024 tokens, each kernel with its
time, the bytes it must read (the distinct experts the routing touches, in the form that kernel
reads them: MXFP4 codes and scales, or the expert cache's bf16 stacks, plus activations), that
as a fraction of the measured copy bandwidth, its error ratio against the reference table's
output (checked: `ok`) and its time against nvidia's Triton kernel. Kernels: `ppu_cache`,
`ppu_cache_slots`, `ppu_mxfp4_host`, `ppu_mxfp4_device`, `reference_table`, `naive`, `nvidia`
(bench/ppu_backend.py's docstring says what each is).
"""

from __future__ import annotations

import sys
import time

import torch

from k3 import reference as ref
from k3.config import K3Config

STARTED = time.perf_counter()
MOE_TOLERANCE = 2e-2          # error ratio of a bf16 experts output against the reference table's


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn over `reps` calls after `warmup` calls (host clock around a
    device synchronisation: works on any torch device, Triton or not)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def copy_GBps(device: str, nbytes: int) -> float:
    """Device copy bandwidth: bytes read plus written per second of one `nbytes` copy."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed_ms(lambda: dst.copy_(src), 10) / 1e6


# the routed experts of one layer

def moe_kernels(device: str, args) -> dict:
    """name -> (experts fn, dense_dispatch, reads the cache's bf16 stacks, largest T it runs at)."""
    from k3.platforms.torch_kernels.moe_experts import experts_forward as reference_experts
    from k3.platforms.torch_kernels.moe_w4a16 import W4A16Experts, build_experts

    built = build_experts(device)
    slots = W4A16Experts(grouped=False, compiled=built.compiled)
    kernels = {"reference_table": (reference_experts, False, False, None),
               "ppu_cache": (built, True, True, None), "ppu_cache_slots": (slots, True, True, 64),
               "ppu_mxfp4_host": (built, False, False, None), "ppu_mxfp4_device": (built, True, False, 64),
               "naive": (ref.experts_forward, False, False, args.naive_moe_tokens)}
    if device.startswith("cuda"):
        try:
            from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward as nvidia_experts

            kernels["nvidia"] = (nvidia_experts, False, False, None)
        except ImportError as err:
            log(f"no nvidia experts: {err}")
    return kernels


def moe_figures(cfg: K3Config, device: str, args, out: dict, save) -> None:
    from k3.platforms.torch_kernels.mxfp4_lut import lut_dequantize
    from k3.quant.mxfp4 import MXFP4Tensor

    e, k = cfg.num_experts, cfg.num_experts_per_token
    hidden, inter = cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    def scales(*shape):                      # 2^-8 .. 2^-5: finite weights of a sensible size
        return torch.randint(119, 122, shape, dtype=torch.uint8, device=device, generator=g)

    w13 = MXFP4Tensor(codes(e, 2 * inter, hidden // 2), scales(e, 2 * inter, hidden // 32))
    w2 = MXFP4Tensor(codes(e, hidden, inter // 2), scales(e, hidden, inter // 32))
    cache = tuple(lut_dequantize(w, torch.empty(w.shape, dtype=dtype, device=device)) for w in (w13, w2))  # the
    # expert cache of one layer (what MoE.hold_experts_dense holds, without fp32 temporaries of the whole stack)
    per_expert = {False: (w13.packed[0].numel() + w13.scales[0].numel() + w2.packed[0].numel()
                          + w2.scales[0].numel()),
                  True: 3 * inter * hidden * dtype.itemsize}
    kernels = moe_kernels(device, args)
    out["copy_GBps"] = copy_GBps(device, args.copy_bytes)
    out["shape"] = {"experts": e, "top_k": k, "hidden": hidden, "inter": inter, "dtype": args.dtype,
                    "bytes_per_expert_mxfp4": per_expert[False], "bytes_per_expert_cache": per_expert[True]}
    out["rows"] = []
    for t in args.moe_tokens:
        x = torch.randn(t, hidden, device=device, generator=g).to(dtype)
        ids = torch.rand(t, e, device=device, generator=g).topk(k, dim=-1).indices.int()
        tw = torch.rand(t, k, device=device, generator=g)
        touched = int(ids.unique().numel())
        want, nvidia_ms = None, None
        for name, (fn, dense, reads_cache, max_t) in kernels.items():
            if time.perf_counter() - STARTED > args.budget_s:
                out["skipped"] = "time budget"
                return
            if max_t is not None and t > max_t:
                continue
            ws = cache if reads_cache else (w13, w2)
            call = lambda: fn(x, *ws, tw, ids, activation="situ", beta=4.0, dense_dispatch=dense)  # noqa: E731
            naive = name == "naive"
            try:
                got = call()
                want = got if want is None else want
                ms = timed_ms(call, args.naive_reps if naive else args.reps, warmup=0 if naive else 2)
            except Exception as err:                   # report, don't hide
                out["rows"].append({"kernel": name, "tokens": t, "error": f"{type(err).__name__}: {err}"})
                continue
            nbytes = touched * per_expert[reads_cache] + 2 * x.numel() * x.element_size()
            row = {"kernel": name, "tokens": t, "ms": ms, "experts_touched": touched, "bytes": nbytes,
                   "reads": "bf16 cache" if reads_cache else "mxfp4", "GBps": nbytes / ms / 1e6,
                   "roofline_fraction": nbytes / ms / 1e6 / out["copy_GBps"],
                   "error_ratio_vs_reference_table": ((got.double() - want.double()).norm()
                                                      / want.double().norm().clamp_min(1e-30)).item()}
            row["ok"] = row["error_ratio_vs_reference_table"] < MOE_TOLERANCE     # checked before it counts
            if not row["ok"]:
                log(f"moe {name} T={t}: error ratio {row['error_ratio_vs_reference_table']:.2e} against the "
                    "reference table: WRONG")
            if naive:
                row["note"] = f"k3.reference oracle, {args.naive_reps} repetitions, no warm-up"
            if name == "nvidia":
                nvidia_ms = ms
            out["rows"].append(row)
            save(f"moe {name} T={t}: {ms:.3f} ms, {row['roofline_fraction']:.3f} of the byte roofline")
        for row in out["rows"]:
            if row["tokens"] == t and nvidia_ms and "ms" in row:
                row["vs_nvidia"] = row["ms"] / nvidia_ms
    del cache


