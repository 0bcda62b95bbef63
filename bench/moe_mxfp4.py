"""MXFP4 routed experts (k3's Triton W4A16 kernel, SiTU-GLU fused) against the torch reference
at k3-slice dimensions (latent L = 3584, expert width I = 3072, 128 experts, top-16, bf16
activations), in one call on the GPU.

    python3 bench/moe_mxfp4.py --out moe_mxfp4.json              # on the H200
    TRITON_INTERPRET=1 python3 bench/moe_mxfp4.py --smoke         # CPU: correctness only, tiny

Each decode batch also times what the nvidia platform serves for `moe.experts` (`k3_served_us`,
`served_kernel`: the promoted moe_experts_bf16 on the experts repacked tile-major, unless
K3_NVIDIA_DISABLE names it), beside `k3_default_us` (experts_forward's default launch on the
checkpoint layout).

For each batch size T: a correctness check against `k3.reference.experts_forward` on the same
fresh random weights and routing (error ratio), then the median time of the kernel and of the
reference (which dequantises each active expert to fp32 and multiplies), and the weight-bytes
roofline: every active expert's packed weights and scales read once, over the measured copy
bandwidth (decode is bound by those bytes). Routing is uniform random, so T tokens activate
about 128 * (1 - (1 - 16/128)^T) experts.
"""

from __future__ import annotations

import argparse

import torch

from k3.platforms.torch_kernels import moe_experts as torch_experts  # the reference platform's kernel
from k3.quant.mxfp4_tiles import to_tile_major
from k3.quant.mxfp4 import MXFP4Tensor
from measure import bench_ms, graph_replay_ms, matmul_tflops, ratio, run_header, save

SITU_BETA = 4.0


def _gemv(block_n, block_k, num_warps, row_split, prefetch, chain=0):
    """A gemv launch: chain 0 for the fp32-product form, else the fp16x2 form with that chain."""
    return dict(mode="gemv", block_n=block_n, block_k=block_k, num_warps=num_warps, row_split=row_split,
                prefetch=prefetch, half=bool(chain), **({"chain": chain} if chain else {}))


# launch options of experts_forward swept per batch size (each checked before it is timed)
VARIANTS = {
    "ds_n64_k128_t16": dict(mode="dot_scaled", block_n=64, block_k=128, block_t=16),
    "ds_n128_k64_t16_w8": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=16, num_warps=8),
    # issue 27: deeper software pipelines and longer column steps for 16-64-token batches
    **{f"ds_n{n}_k{k}_t16_w{w}_s{st}": dict(mode="dot_scaled", block_n=n, block_k=k, block_t=16, num_warps=w,
                                            stages=st)
       for n, k, w, st in ((128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4))},
    # issue 27: the codes decoded to bf16 pairs in the registers by PTX (decode_bf16), bf16 tensor-core
    # products without dot_scaled's upcast; "dbbits": the same tiles decoded by fp32 bit placement
    **{f"db_n{n}_k{k}_t16_w{w}_s{st}": dict(mode="decode_bf16", block_n=n, block_k=k, block_t=16, num_warps=w,
                                            stages=st)
       for n, k, w, st in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3),
                           (64, 128, 4, 4), (64, 256, 4, 3), (256, 64, 8, 3))},
    **{f"dbfold_n{n}_k{k}_t16_w{w}_s{st}": dict(mode="decode_bf16", ptx="folded", block_n=n, block_k=k, block_t=16,
                                                num_warps=w, stages=st)       # the bench's scale codes are <= 128
       for n, k, w, st in ((128, 64, 8, 3), (128, 128, 8, 3))},
    "dbbits_n128_k64_t16_w8_s3": dict(mode="decode_bf16", ptx=False, block_n=128, block_k=64, block_t=16,
                                      num_warps=8, stages=3),
    # the same tiles with each step's scale codes and activation columns loaded where they are used (a round
    # trip to memory every step, as before the loads were pipelined, issue 27)
    "inloop_dbfold_n128_k64_t16_w8_s3": dict(mode="decode_bf16", ptx="folded", block_n=128, block_k=64, block_t=16,
                                             num_warps=8, stages=3, pipelined_loads=False),
    "inloop_ds_n128_k64_t16_w8": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=16, num_warps=8,
                                      pipelined_loads=False),
    # the same tiles reading a tile-major copy of the experts (k3.quant.mxfp4_tiles) (4 KB of codes a step, contiguous;
    # "inloop_scales": the scale codes loaded in the step, not a step ahead)
    **{f"tiled_{name}": dict(options, tiled=True) for name, options in (
        ("dbfold_n128_k64_t16_w8_s3", dict(mode="decode_bf16", ptx="folded", block_n=128, block_k=64, block_t=16,
                                           num_warps=8, stages=3)),
        ("inloop_scales_dbfold_n128_k64_t16_w8_s3", dict(mode="decode_bf16", ptx="folded", block_n=128, block_k=64,
                                                         block_t=16, num_warps=8, stages=3, scales_ahead=False)),
        ("db_n128_k64_t16_w8_s3", dict(mode="decode_bf16", block_n=128, block_k=64, block_t=16, num_warps=8,
                                       stages=3)),
        ("dbfold_n128_k64_t16_w8_s4", dict(mode="decode_bf16", ptx="folded", block_n=128, block_k=64, block_t=16,
                                           num_warps=8, stages=4)),
        ("dbfold_n64_k64_t16_w4_s3", dict(mode="decode_bf16", ptx="folded", block_n=64, block_k=64, block_t=16,
                                          num_warps=4, stages=3)),
        ("ds_n128_k64_t16_w8", dict(mode="dot_scaled", block_n=128, block_k=64, block_t=16, num_warps=8)),
        ("gemv_n32_k512_w4_u4", _gemv(32, 512, 4, 4, False)),         # the served gemv (1-16 tokens)
        ("gemv_n32_k512_w4_u4_pf", _gemv(32, 512, 4, 4, True)))},
    # fp32 products (the eighth session's served form): several weight rows per thread (u: row_split),
    # weights loaded a step ahead (pf: prefetch)
    "gemv_n32_k512_w4_u4": _gemv(32, 512, 4, 4, False),
    "gemv_n32_k256_w2_u4_pf": _gemv(32, 256, 2, 4, True),
    # fp16x2 products on scaled fp16 activations (h: words chained in fp16 per fp32 add, 4 or 1)
    "gemv_n32_k512_w4_u4_h4": _gemv(32, 512, 4, 4, False, chain=4),
    "gemv_n32_k512_w4_u4_h1": _gemv(32, 512, 4, 4, False, chain=1),
    "gemv_n32_k256_w2_u4_pf_h4": _gemv(32, 256, 2, 4, True, chain=4),
    "gemv_n32_k512_w4_u4_pf_h4": _gemv(32, 512, 4, 4, True, chain=4),
    "gemv_n64_k256_w4_u4_h4": _gemv(64, 256, 4, 4, False, chain=4),
    "gemv_n64_k256_w4_u8_pf_h4": _gemv(64, 256, 4, 8, True, chain=4),
    "gemv_n64_k512_w8_u4_h4": _gemv(64, 512, 8, 4, False, chain=4),
    # the fp16x2 gemv with each weight tile decoded once for up to g pairs of its expert (issue 27)
    **{f"gg{g}_n{n}_k{k}_w{w}_u4_h4": dict(mode="gemv_grouped", group_tokens=g, block_n=n, block_k=k, num_warps=w,
                                           row_split=4, chain=4)
       for g, n, k, w in ((2, 32, 512, 4), (4, 32, 512, 4), (8, 32, 512, 4), (4, 32, 256, 4), (8, 32, 256, 4),
                          (8, 32, 256, 2), (4, 64, 256, 4), (2, 32, 128, 4), (4, 32, 128, 4), (4, 32, 128, 8),
                          (2, 32, 64, 4))},
}
# prefill batches (PREFILL_T tokens and up, ~T*k/E >= 64 per expert): larger token tiles and the
# dequantise-then-cuBLAS mode, timed
# eagerly (prefill is not captured) against the bf16 matrix-product rate
PREFILL_VARIANTS = {        # the sixth session's sweep of nine tile shapes kept its best two (BENCHMARKS.md)
    "ds_n128_k64_t16_w8": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=16, num_warps=8),
    "ds_n128_k64_t64_w4_s4": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=64, num_warps=4, stages=4),
    "ds_n128_k64_t128_w8_s3": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=128, num_warps=8, stages=3),
    "dequant": dict(mode="dequant"),      # active experts dequantised to bf16 a group at a time, grouped products
    # the served prefill tile with its scale and activation loads where they are used (issue 27's fix measured)
    "inloop_ds_n128_k64_t64_w4_s4": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=64, num_warps=4,
                                         stages=4, pipelined_loads=False),
    # both prefill modes reading moe_mxfp4_layout's tile-major copy of the experts
    "tiled_ds_n128_k64_t64_w4_s4": dict(mode="dot_scaled", block_n=128, block_k=64, block_t=64, num_warps=4,
                                        stages=4, tiled=True),
    "tiled_dequant": dict(mode="dequant", tiled=True),
}
PREFILL_T = 512
GEMV_MAX_T = 32          # one program per (expert, token): past a few tokens per expert the tensor cores win


def served_experts_kernel():
    """(name, function) of what the nvidia platform serves `moe.experts` with in this environment
    (K3_NVIDIA_DISABLE / K3_NVIDIA_EXPERIMENTAL apply): `k3_served_us` times it on the experts as
    the plugin's k3_process_weights leaves them (tile-major for moe_experts_bf16)."""
    from k3.platforms.nvidia import experimental

    name = experimental.serving("moe.experts")
    if name is None:
        raise SystemExit("the nvidia platform serves moe.experts with the reference op here (K3_NVIDIA_DISABLE?)")
    return name, experimental.ALL[name].function()


def make_experts(e, inter, l, device, seed):
    """Random MXFP4 experts, quantised one expert at a time (k3-slice's are 128 x 12.6 MiB)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = [MXFP4Tensor.from_float(torch.randn(2 * inter, l, device=device, generator=g) / l ** 0.5) for _ in range(e)]
    w2 = [MXFP4Tensor.from_float(torch.randn(l, inter, device=device, generator=g) / inter ** 0.5) for _ in range(e)]
    stack = lambda ws: MXFP4Tensor(torch.stack([w.packed for w in ws]), torch.stack([w.scales for w in ws]))  # noqa: E731
    return stack(w13), stack(w2)


def make_tokens(t, e, l, k, device, seed):
    """x [T, L] bf16, routing weights [T, k] (normalised), ids [T, k]: fresh random."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights, ids = torch.rand(t, e, device=device, generator=g).topk(k, dim=-1)
    x = torch.randn(t, l, device=device, generator=g).bfloat16()
    return x, weights / weights.sum(-1, keepdim=True), ids


def variant(options: dict, experts, tiles):
    """A VARIANTS / PREFILL_VARIANTS entry as (experts_forward's options, the (w13, w2) it runs
    on): a "tiled" entry runs on the experts' tile-major copy `tiles`, the others on `experts`."""
    return {k: v for k, v in options.items() if k != "tiled"}, tiles if options.get("tiled") else experts


def weight_bytes(w13: MXFP4Tensor, w2: MXFP4Tensor, ids: torch.Tensor) -> int:
    per_expert = sum(w.packed[0].numel() + w.scales[0].numel() for w in (w13, w2))
    return per_expert * ids.unique().numel()


def check(kernel, w13, w2, t, k, device, seed) -> dict:
    e, l = w13.shape[0], w13.shape[2]
    x, weights, ids = make_tokens(t, e, l, k, device, seed)
    kw = {"activation": "situ", "beta": SITU_BETA}
    got = kernel(x, w13, w2, weights, ids, **kw)
    want = torch_experts.experts_forward(x.double(), w13, w2, weights.double(), ids, **kw)
    err = ratio(got, want)
    return {"error_ratio": err, "finite": bool(got.isfinite().all()), "passed": err < 1e-2 and bool(got.isfinite().all())}


def pick_best(entry: dict) -> None:
    """entry["k3_best_variant"] and entry["k3_us"]: the fastest of its timed launches (the
    k3_<variant>_us keys; eager timings of the default launch are not candidates)."""
    timed = {key[3:-3]: v for key, v in entry.items()
             if key.startswith("k3_") and key.endswith("_us") and not key.endswith("eager_us")}
    entry["k3_best_variant"] = min(timed, key=timed.get)
    entry["k3_us"] = timed[entry["k3_best_variant"]]


def prefill_entry(entry, kernel, w13, w2, x, weights, ids, k, t, tflops, kw, tiles=None) -> None:
    """A prefill batch: each PREFILL_VARIANTS launch checked, then timed eagerly; the figure is
    the best one's fraction of the bf16 matrix-product rate (2 * T * k * 3 * L * I FLOPs)."""
    e, two_i, l = w13.shape
    flops = 2 * t * k * 3 * l * (two_i // 2)
    entry["tflop"] = flops / 1e12
    entry["matmul_floor_us"] = flops / tflops / 1e6
    for name, options in PREFILL_VARIANTS.items():
        options, (a13, a2) = variant(options, (w13, w2), tiles)
        entry[f"{name}_check"] = check(lambda *a, **kk: kernel(*a, **options, **kk), a13, a2, t, k, "cuda", seed=t)
        if entry[f"{name}_check"]["passed"]:
            entry[f"k3_{name}_us"] = bench_ms(lambda: kernel(x, a13, a2, weights, ids, **options, **kw)) * 1e3
    entry["k3_default_us"] = bench_ms(lambda: kernel(x, w13, w2, weights, ids, **kw)) * 1e3
    pick_best(entry)
    entry["fraction_of_matmul_rate"] = entry["matmul_floor_us"] / entry["k3_us"]
    entry["reference_us"] = bench_ms(lambda: torch_experts.experts_forward(x, w13, w2, weights, ids, **kw), 1000) * 1e3
    entry["speedup_vs_reference"] = entry["reference_us"] / entry["k3_us"]
    print(f"T{t}: k3 {entry['k3_us']:.0f} us ({entry['k3_best_variant']}; default {entry['k3_default_us']:.0f} us), "
          f"{100 * entry['fraction_of_matmul_rate']:.0f}% of the bf16 matmul rate, reference {entry['reference_us']:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_mxfp4.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    parser.add_argument("--variants", nargs="+", default=[],
                        help="decode-batch launches to sweep: names starting with these (default: all of VARIANTS)")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward as kernel

    if args.smoke:
        w13, w2 = make_experts(8, 64, 96, "cpu", seed=0)
        result = check(kernel, w13, w2, 5, 3, "cpu", seed=1)
        print(result)
        assert result["passed"], result
        return
    e, inter, l, k = 128, 3072, 3584, 16
    result = run_header(f"E{e} top{k} L{l} I{inter} MXFP4 experts, bf16 activations, SiTU-GLU beta {SITU_BETA}")
    copy_GBps = result["copy_GBps"]
    result["bf16_matmul_TFLOPs"] = tflops = matmul_tflops()
    rows = []
    w13, w2 = make_experts(e, inter, l, "cuda", seed=0)
    tiles = (to_tile_major(w13), to_tile_major(w2))           # the tiled_ variants' experts (k3.quant.mxfp4_tiles)
    served_name, served = served_experts_kernel()
    served_experts = tiles if served_name == "moe_experts_bf16" else (w13, w2)    # as k3_process_weights leaves them
    for t in args.batch:
        entry = {"check": check(kernel, w13, w2, t, k, "cuda", seed=t)}
        if entry["check"]["passed"]:
            x, weights, ids = make_tokens(t, e, l, k, "cuda", seed=100 + t)
            kw = {"activation": "situ", "beta": SITU_BETA}
            nbytes = weight_bytes(w13, w2, ids)
            entry["active_experts"] = int(ids.unique().numel())
            entry["weight_bytes"] = nbytes
            entry["roofline_us"] = nbytes / copy_GBps / 1e3
            if t >= PREFILL_T:
                prefill_entry(entry, kernel, w13, w2, x, weights, ids, k, t, tflops, kw, tiles)
                result[f"T{t}"] = entry
                rows.append((t, entry))
                torch.cuda.empty_cache()
                save(result, args.out)
                continue
            for name, options in VARIANTS.items():
                if t < 16 and options.get("block_t", 16) > 16:
                    continue                                  # a token block of 32+ for 1-4 tokens: waste
                if options["mode"] == "gemv" and t > GEMV_MAX_T or options["mode"] == "gemv_grouped" and t == 1:
                    continue
                if args.variants and not name.startswith(tuple(args.variants)):
                    continue
                options, (a13, a2) = variant(options, (w13, w2), tiles)
                entry[f"{name}_check"] = check(lambda *a, **k: kernel(*a, **options, **k), a13, a2, t, k, "cuda",
                                               seed=t)
                if entry[f"{name}_check"]["passed"]:
                    # replayed from a CUDA graph, as a decode step runs it (eager times at small T
                    # are mostly the host launching the grouping ops and the two kernels)
                    entry[f"k3_{name}_us"] = graph_replay_ms(
                        lambda: kernel(x, a13, a2, weights, ids, **options, **kw)) * 1e3
            entry["k3_default_us"] = graph_replay_ms(lambda: kernel(x, w13, w2, weights, ids, **kw)) * 1e3
            entry["served_kernel"] = served_name
            entry["k3_served_check"] = check(served, *served_experts, t, k, "cuda", seed=t)
            if entry["k3_served_check"]["passed"]:
                entry["k3_served_us"] = graph_replay_ms(lambda: served(x, *served_experts, weights, ids, **kw)) * 1e3
            entry["k3_default_eager_us"] = bench_ms(lambda: kernel(x, w13, w2, weights, ids, **kw)) * 1e3
            pick_best(entry)
            entry["fraction_of_roofline"] = entry["roofline_us"] / entry["k3_us"]
            entry["reference_us"] = bench_ms(lambda: torch_experts.experts_forward(x, w13, w2, weights, ids, **kw), 1000) * 1e3
            entry["speedup_vs_reference"] = entry["reference_us"] / entry["k3_us"]
        result[f"T{t}"] = entry
        rows.append((t, entry))
        torch.cuda.empty_cache()
        save(result, args.out)
    print(f"copy bandwidth {copy_GBps:.0f} GB/s")
    print(f"{'T':>4} {'ok':<4} {'experts':>7} {'k3 us':>9} {'eager us':>9} {'roofline':>9} {'%roof':>6} {'ref us':>10} "
          f"{'vs ref':>7} best (k3: CUDA-graph replay; eager: the default launch)")
    for t, e_ in rows:
        if "fraction_of_matmul_rate" in e_:
            continue                                          # prefill rows: printed as they ran
        if "k3_us" not in e_:
            print(f"{t:>4} FAIL {e_['check']}")
            continue
        print(f"{t:>4} {'ok':<4} {e_['active_experts']:>7} {e_['k3_us']:9.1f} {e_['k3_default_eager_us']:9.1f} "
              f"{e_['roofline_us']:9.1f} {100 * e_['fraction_of_roofline']:5.0f}% {e_['reference_us']:10.1f} "
              f"{e_['speedup_vs_reference']:6.1f}x {e_['k3_best_variant']}")


if __name__ == "__main__":
    main()
