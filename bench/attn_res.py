"""The fused Block AttnRes step (k3's Triton kernel) against the torch reference step at K3's
hidden size (D = 7168, bf16), in one call on the GPU.

    python3 bench/attn_res.py --out attn_res.json

Per T (1, 64, 8192 tokens): a check against `k3.reference.attn_res` in float64 on the same
fresh inputs (the block boundary case: delta added, the finished block written, 8 visible
blocks mixed, output RMSNorm), then median times of both (CUDA events; the decode sizes also
replayed from a CUDA graph, where launch overhead no longer counts) and the floor: the bytes
the step must move (partial sum and delta read, partial sum and bank row written, visible
blocks read, h written) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from k3 import reference as ref
from measure import bench_ms, graph_replay_ms, ratio, run_header, save

D, BANK, VISIBLE = 7168, 12, 8
LAUNCH_VARIANTS = ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (2048, 16))   # (block_d, warps)


def inputs(t, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    kw = dict(query=rnd(D) * 0.05, num_visible_blocks=VISIBLE, write_index=VISIBLE, eps=1e-6,
              out_norm_weight=rnd(D) * 0.1 + 1, out_eps=1e-5)
    return rnd(t, D), rnd(t, D), rnd(t, BANK, D), kw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attn_res.json")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.attn_res import attn_res as kernel

    result = run_header(f"D{D} bank {BANK} visible {VISIBLE} bf16, delta + write + mix + RMSNorm")
    copy_GBps = result["copy_GBps"]
    for t in (1, 64, 8192):
        prefix, delta, blocks, kw = inputs(t, seed=t)
        mine = blocks.clone()
        got = kernel(prefix, delta, mine, **kw)
        oracle = blocks.double()
        want = ref.attn_res(prefix.double(), delta.double(), oracle, **{
            **kw, "query": kw["query"].double(), "out_norm_weight": kw["out_norm_weight"].double()})
        h, p, want_h, want_p = got.h, got.prefix, want.h, want.prefix
        entry = {"error_ratio_h": ratio(h, want_h), "error_ratio_prefix": ratio(p, want_p),
                 "error_ratio_bank": ratio(mine, oracle)}
        entry["passed"] = max(entry.values()) < 2e-2
        if entry["passed"]:
            entry["k3_us"] = bench_ms(lambda: kernel(prefix, delta, blocks, **kw)) * 1e3
            entry["reference_us"] = bench_ms(lambda: ref.attn_res(prefix, delta, blocks, **kw)) * 1e3
            if t <= 64:
                entry["k3_graph_us"] = graph_replay_ms(lambda: kernel(prefix, delta, blocks, **kw)) * 1e3
                # launch variants, 16 back-to-back steps a graph (a decode step runs 24 of them
                # between other kernels; one step a graph mostly times the graph launch)
                for block_d, warps in LAUNCH_VARIANTS:
                    options = {"block_d": block_d, "num_warps": warps}
                    variant = kernel(prefix, delta, blocks.clone(), **kw, **options)
                    if max(ratio(variant.h, want_h), ratio(variant.prefix, want_p)) >= 2e-2:
                        entry[f"d{block_d}_w{warps}_failed"] = True
                        continue
                    entry[f"k3_d{block_d}_w{warps}_graph16_us"] = graph_replay_ms(
                        lambda: [kernel(prefix, delta, blocks, **kw, **options) for _ in range(16)]) * 1e3 / 16
                entry["reference_graph_us"] = graph_replay_ms(lambda: ref.attn_res(prefix, delta, blocks, **kw)) * 1e3
            nbytes = t * D * 2 * (2 + 2 + VISIBLE + 1)
            entry["floor_us"] = nbytes / copy_GBps / 1e3
            entry["fraction_of_copy_bw"] = entry["floor_us"] / entry.get("k3_graph_us", entry["k3_us"])
        result[f"T{t}"] = entry
        save(result, args.out)
    save(result, args.out, show=True)


if __name__ == "__main__":
    main()
