"""Driver for profiling the MXFP4 routed experts under Nsight Compute on the GPU: k3-slice
dimensions, one routing at batch T, the default launch (what a decode step runs), a few calls.

    ncu --clock-control none -k regex:"gate_up_kernel|down_kernel" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis python3 bench/moe_profile.py --batch 1
"""

from __future__ import annotations

import argparse

import torch

from moe_mxfp4 import SITU_BETA, make_experts, make_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    from k3.platforms.triton_kernels.moe_mxfp4 import experts_forward

    e, inter, l, k = 128, 3072, 3584, 16
    w13, w2 = make_experts(e, inter, l, "cuda", seed=0)
    x, weights, ids = make_tokens(args.batch, e, l, k, "cuda", seed=1)
    for _ in range(args.calls):
        experts_forward(x, w13, w2, weights, ids, activation="situ", beta=SITU_BETA)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
