"""The MXFP4 experts' two kernels at decode batch sizes, launched for Nsight Compute (issue 27).

    ncu --set full --profile-from-start off --kernel-name regex:'_gate_up_kernel|_down_kernel' \\
        python3 bench/moe_ncu.py --batch 64 --variants db ds                # on the GPU

k3-slice's MoE dimensions (bench/moe_mxfp4.py's experts and routing): for each batch size and
each named launch (bench/moe_mxfp4.py's VARIANTS, "db" / "ds" for the decode_bf16 and dot_scaled
tiles the bench times, "tdb" the decode_bf16 tile on the tiled layout), the launch is checked against the fp64 reference once, run twice to
compile and warm up, then run `--profiled` times more between cudaProfilerStart and Stop: those
are the launches ncu profiles (`--profile-from-start off`). Each launch's median time is printed.
"""

from __future__ import annotations

import argparse
import sys

import torch

from measure import bench_ms
from moe_mxfp4 import SITU_BETA, VARIANTS, check, make_experts, make_tokens, variant

from k3.quant.mxfp4_tiles import to_tile_major

SHORT = {"db": "dbfold_n128_k64_t16_w8_s3", "ds": "ds_n128_k64_t16_w8", "tdb": "tiled_dbfold_n128_k64_t16_w8_s3"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--variants", nargs="+", default=["db", "ds"],
                        help="VARIANTS names (or db / ds) in launch order")
    parser.add_argument("--profiled", type=int, default=1, help="launches a variant after its two warm-up runs")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward as kernel

    e, inter, l, k = 128, 3072, 3584, 16
    w13, w2 = make_experts(e, inter, l, "cuda", seed=0)
    tiles = (to_tile_major(w13), to_tile_major(w2))
    kw = {"activation": "situ", "beta": SITU_BETA}
    failed = False
    for t in args.batch:
        x, weights, ids = make_tokens(t, e, l, k, "cuda", seed=100 + t)
        for name in args.variants:
            options, (a13, a2) = variant(VARIANTS[SHORT.get(name, name)], (w13, w2), tiles)
            result = check(lambda *a, **kk: kernel(*a, **options, **kk), a13, a2, t, k, "cuda", seed=t)
            failed |= not result["passed"]
            for _ in range(2):
                kernel(x, a13, a2, weights, ids, **options, **kw)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for _ in range(args.profiled):
                kernel(x, a13, a2, weights, ids, **options, **kw)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            ms = bench_ms(lambda: kernel(x, a13, a2, weights, ids, **options, **kw))
            print(f"T{t} {SHORT.get(name, name)}: {ms * 1e3:.0f} us, check {result}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
