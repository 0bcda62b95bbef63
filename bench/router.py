"""The router on the nvidia platform (Triton) against the reference ops on the same GPU at
k3-slice's dimensions (hidden 7168, 128 experts, top-16, sigmoid scores with a correction bias),
in one call on the GPU.

    python3 bench/router.py --out router.json

Per batch T (decode sizes): a check of the Triton router logits against the reference in
float64 (error ratio) and of the selection (ids equal to the reference's on the same logits),
then CUDA-graph replay times of logits + selection, each part and together, for both
(the reference: h upcast to fp32, cuBLAS's fp32 GEMV, torch's sigmoid / top-k chain), and the
floor: the fp32 gate read once over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from k3 import reference as ref
from measure import graph_replay_ms, ratio, run_header, save

D, E, TOP_K = 7168, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="router.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    from k3.platforms.triton_kernels import router

    result = run_header(f"router D{D} E{E} top{TOP_K}")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(E, D, device="cuda", generator=g) * D ** -0.5
    bias = 0.1 * torch.randn(E, device="cuda", generator=g)
    sel = dict(top_k=TOP_K, correction_bias=bias, routed_scaling_factor=2.5)
    for t in args.batch:
        h = torch.randn(t, D, device="cuda", generator=g).bfloat16()
        logits = router.router_logits(h, w)
        entry = {"logits_error_ratio": ratio(logits, ref.router_logits(h.double(), w.double())),
                 "ids_equal": bool(torch.equal(router.select_experts(logits, **sel).ids,
                                               ref.select_experts(logits, **sel).ids))}
        entry["passed"] = entry["logits_error_ratio"] < 1e-5 and entry["ids_equal"]
        if entry["passed"]:
            entry["k3_logits_us"] = graph_replay_ms(lambda: router.router_logits(h, w)) * 1e3
            entry["reference_logits_us"] = graph_replay_ms(lambda: ref.router_logits(h, w)) * 1e3
            entry["k3_us"] = graph_replay_ms(lambda: router.select_experts(router.router_logits(h, w), **sel)) * 1e3
            entry["reference_us"] = graph_replay_ms(lambda: ref.select_experts(ref.router_logits(h, w), **sel)) * 1e3
            entry["speedup_vs_reference"] = entry["reference_us"] / entry["k3_us"]
            entry["floor_us"] = w.numel() * 4 / result["copy_GBps"] / 1e3
            print(f"T{t}: logits {entry['k3_logits_us']:.1f} us (reference {entry['reference_logits_us']:.1f}), "
                  f"with selection {entry['k3_us']:.1f} us (reference {entry['reference_us']:.1f}), "
                  f"floor {entry['floor_us']:.1f} us")
        result[f"T{t}"] = entry
        save(result, args.out)
    save(result, args.out, show=True)


if __name__ == "__main__":
    main()
