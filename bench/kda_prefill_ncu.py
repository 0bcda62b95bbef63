"""The chunked KDA prefill's phase kernels at 8K tokens and 96 heads, launched for Nsight Compute
(issue 27 item 2: why phase 1 and the recurrence take milliseconds).

    ncu --set full --profile-from-start off -f -o kda_ncu python3 bench/kda_prefill_ncu.py   # on the GPU

Builds phase 1's packed fp32 inputs (bench/kda_prefill.py's `make`: K3-like gates, l2-normed
keys) and its chunk index, runs each named form twice to compile and warm up, then once more
between cudaProfilerStart and Stop (the launches ncu profiles with `--profile-from-start off`):
phase 1 in the "blocks" form and the "split" form with the diagonal blocks' decays as [16, 16, slice]
tensors, each also with its diagonal blocks a column at a time (`diag_columns`, served in blocks since
2026-12-07; outputs checked against blocks'), then the fused recurrence and the
split one (state and output kernels, and its output launch over 128 columns or with 8 warps) on
the blocks form's outputs, each checked against the fused kernel's o and final state. Each form's median time over
five runs is printed first.
"""

from __future__ import annotations

import argparse

import torch

from kda_prefill import make
from measure import bench_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--forms", nargs="+", default=["blocks", "blocks_columns", "split", "split_columns", "fused",
                                                       "state_split"])
    args = parser.parse_args()
    from k3.platforms.triton_kernels import kda_chunked_recurrence as fused
    from k3.platforms.triton_kernels import kda_chunked_state as split_state
    from k3.platforms.triton_kernels.kda_intra_chunk import intra_chunk

    (q, k, v, gate, beta), kw = make([args.tokens])
    C, T, HV = 64, args.tokens, q.shape[2]
    rows = lambda x: torch.cat([x[0].float(), x.new_zeros(1, *x.shape[2:]).float()])  # noqa: E731  [T + 1, HV, *]
    qf, kf, vf, gf, bf = (rows(x) for x in (q * q.shape[-1] ** -0.5, k, v, gate, beta))
    index = torch.arange(T, device="cuda").view(-1, C)
    nseg = index.shape[0]
    phase1 = intra_chunk(qf, kf, vf, gf, bf, index)
    order, sizes, h0 = [0], [1] * nseg, kw["initial_state"].float()
    o = torch.empty(T, HV, v.shape[-1], dtype=torch.bfloat16, device="cuda")     # the served o rows
    served = dict(precision="tf32x3", out=o, out_index=index)
    runs = {
        # the diagonal blocks' decays as [16, 16, slice] tensors (blocks was served so until 2026-12-07)
        "blocks": lambda: intra_chunk(qf, kf, vf, gf, bf, index, form="blocks", diag_columns=False),
        "split": lambda: intra_chunk(qf, kf, vf, gf, bf, index, form="split", diag_columns=False),
        # the diagonal blocks a column at a time (no [16, 16, slice] tensors)
        "blocks_columns": lambda: intra_chunk(qf, kf, vf, gf, bf, index, form="blocks", diag_columns=True),
        "split_columns": lambda: intra_chunk(qf, kf, vf, gf, bf, index, form="split", diag_columns=True),
        "fused": lambda: fused.recurrence(*phase1, h0, order, sizes, **served),
        "state_split": lambda: split_state.recurrence_split(*phase1, h0, order, sizes, block_v=32, **served),
        # the output launch over all 128 columns (qeG and A_qk read once a chunk and head) or 8 warps
        "state_split_o128": lambda: split_state.recurrence_split(*phase1, h0, order, sizes, block_v=32,
                                                                 out_block_v=128, out_num_warps=8, out_k_slice=32,
                                                                 **served),
        "state_split_o64w8": lambda: split_state.recurrence_split(*phase1, h0, order, sizes, block_v=32,
                                                                  out_num_warps=8, out_k_slice=128, **served),
    }
    ratio = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()  # noqa: E731
    served_phase1 = runs["blocks"]()                                  # the reference of the phase-1 forms' checks
    _, served_state, _ = runs["fused"]()
    served_o = o.clone()
    for form in args.forms:
        check = ""
        if form in ("blocks_columns", "split", "split_columns"):       # phase 1's outputs against blocks' (decay tensors)
            got = runs[form]()
            check = "  error ratios " + " ".join(f"{ratio(a, b):.1e}" for a, b in zip(got, served_phase1))
        elif form.startswith("state_split"):                             # o and the final state against the fused kernel's
            o.fill_(float("nan"))
            _, state, _ = runs[form]()
            check = f"  error ratios o {ratio(o, served_o):.1e} state {ratio(state, served_state):.1e}"
        print(f"{form}: {bench_ms(runs[form]):.3f} ms{check}", flush=True)
    for form in args.forms:
        runs[form]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        runs[form]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
