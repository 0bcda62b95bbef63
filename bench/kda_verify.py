"""The KDA recurrence of a speculative verify step (k3's Triton `kda_recurrent`, experimental)
against fla-core's `fused_recurrent_kda` and the torch reference, at K3 per-layer shapes (96
heads, K = V = 128, bf16 q/k/v, fp32 gates and state), in one call on the GPU.

    python3 bench/kda_verify.py --out kda_verify.json
    TRITON_INTERPRET=1 python3 bench/kda_verify.py --smoke        # CPU: correctness only, tiny

Per batch N (1, 16, 64 sequences) of S = 4 tokens each (3 drafts + the last token): a check
against `k3.reference.kda_recurrent` on fresh random inputs (error ratios of o, the final
state, the state after every token and the corrections), then median times (CUDA events;
replayed from a CUDA graph too) of k3 with what "states" rollback needs (per-position states),
k3 with what "recover" rollback needs (corrections only), fla-core (final state only: it has no
per-position output), and the reference. Floor: q, k, v, g, beta and the initial state read
once, o and the final state written once, plus the per-position states (N * S * 96 * 128 * 128
fp32) for the "states" figure, over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse

import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_recurrent as torch_recurrent  # the reference platform's kernel

S, H, D = 4, 96, 128


def make(n, s, h, d, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    t = n * s
    args = (ref.l2_norm(rnd(1, t, h, d)).bfloat16(), ref.l2_norm(rnd(1, t, h, d)).bfloat16(),
            rnd(1, t, h, d).bfloat16(), -5.0 * torch.sigmoid(rnd(1, t, h, d) * 1.5), torch.sigmoid(rnd(1, t, h)))
    cu = torch.arange(0, t + 1, s, device=device, dtype=torch.int32)
    return args, {"initial_state": 0.1 * rnd(n, h, d, d), "cu_seqlens": cu}


def check(kernel, n, s, h, d, device, seed) -> dict:
    from measure import ratio

    args, kw = make(n, s, h, d, device, seed)
    extra = dict(output_per_position_states=True, output_corrections=True)
    got = kernel(*args, **kw, **extra)
    want = torch_recurrent.kda_recurrent(*(a.float() for a in args), **kw, **extra)
    fields = {"o": "o", "final_state": "state", "states": "states", "corrections": "corrections"}
    out = {f"error_ratio_{name}": ratio(getattr(got, f), getattr(want, f)) for name, f in fields.items()}
    out["passed"] = all(v < 2e-2 for v in out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kda_verify.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.kda_recurrent import kda_recurrent as kernel

    if args.smoke:
        result = check(kernel, 3, S, 2, 16, "cpu", seed=0)
        print(result)
        assert result["passed"], result
        return
    from fla.ops.kda import fused_recurrent_kda

    from measure import bench_ms, graph_replay_ms, run_header, save

    result = run_header(f"H{H} K=V{D}, {S} tokens per sequence, bf16 q/k/v, fp32 gates and state")
    copy_GBps = result["copy_GBps"]
    for n in args.batch:
        entry = {"check": check(kernel, n, S, H, D, "cuda", seed=n)}
        if entry["check"]["passed"]:
            a, kw = make(n, S, H, D, "cuda", seed=100 + n)
            runs = {
                "k3_states": lambda: kernel(*a, **kw, output_per_position_states=True),
                "k3_corrections": lambda: kernel(*a, **kw, output_corrections=True),
                "fla_final_state_only": lambda: fused_recurrent_kda(
                    *a, initial_state=kw["initial_state"], output_final_state=True, cu_seqlens=kw["cu_seqlens"]),
            }
            for name, fn in runs.items():
                entry[f"{name}_us"] = bench_ms(fn) * 1e3
                entry[f"{name}_graph_us"] = graph_replay_ms(fn) * 1e3
            entry["reference_us"] = bench_ms(lambda: torch_recurrent.kda_recurrent(*a, **kw, output_per_position_states=True),
                                             rep_ms=1000) * 1e3
            state = n * H * D * D * 4
            inputs = sum(x.numel() * x.element_size() for x in a)
            base = inputs + 2 * state + n * S * H * D * 2                      # + o in bf16
            entry["floor_states_us"] = (base + n * S * H * D * D * 4) / copy_GBps / 1e3
            entry["floor_corrections_us"] = (base + n * S * H * D * 4) / copy_GBps / 1e3
            entry["k3_states_fraction_of_copy_bw"] = entry["floor_states_us"] / entry["k3_states_graph_us"]
            entry["k3_corrections_vs_fla"] = entry["fla_final_state_only_graph_us"] / entry["k3_corrections_graph_us"]
        result[f"N{n}"] = entry
        torch.cuda.empty_cache()
        save(result, args.out)
    save(result, args.out, show=True)


if __name__ == "__main__":
    main()
