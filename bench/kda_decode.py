"""Fused KDA decode step (k3's Triton kernel) against fla-core and the torch reference, at K3
per-layer shapes (96 heads, K = V = 128, conv width 4, bf16 activations, fp32 state in the
cache's rows), in one call on the GPU.

    python3 bench/kda_decode.py --out kda_decode.json            # on the H200
    TRITON_INTERPRET=1 python3 bench/kda_decode.py --smoke        # CPU: correctness only, tiny

For each batch size N and state layout ("hkv", "hvk") it
  1. checks k3's kernel against `k3.reference.kda_decode_step` in float64 on the same fresh
     random inputs (two steps, some rows fresh, state rows read through `state_indices`, rows
     nobody owns poisoned with NaN and checked unchanged): error ratios of o, state and window;
  2. times, per layer, over L layers with their own state pools (so the states are not served
     from L2, as in a real decode where every layer's state is touched once per step):
       - k3 fused step (conv + SiLU + L2 norms + gate + beta + state update + gated RMSNorm),
         eager and replayed from a CUDA graph, for several launch widths;
       - the peer, fla-core's `fused_recurrent_kda` in its serving mode (state updated in place
         through `ssm_state_indices`, gate, beta sigmoid and q/k L2 norm fused): it does the
         recurrence only, i.e. less work than k3's step (no conv, no output norm);
       - the torch reference step (unfused, eager);
  3. reports each time as a fraction of the floor (the fewest bytes the step must move over the
     measured device-to-device copy bandwidth).
Prints a table last; writes every number, the device and the versions to --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math

import torch

from k3.platforms.torch_kernels import kda_decode as torch_kda_decode  # the reference platform's kernel
from measure import bench_ms, copy_bandwidth_GBps, graph_replay_ms, ratio

LOWER_BOUND, NORM_EPS, CONV_WIDTH = -5.0, 1e-5, 4


class Layer:
    """One KDA layer's weights and its cache rows (rows = 2N + 1: only half are stepped)."""

    def __init__(self, n: int, h: int, k: int, layout: str, device: str, gen: torch.Generator):
        def randn(*shape, dtype=torch.bfloat16, s=1.0, shift=0.0):
            return (torch.randn(shape, device=device, generator=gen) * s + shift).to(dtype)

        c, rows = 3 * h * k, 2 * n + 1
        self.conv_weight = randn(c, CONV_WIDTH, s=0.5)
        self.A_log = torch.rand(h, device=device, generator=gen) * math.log(16)
        self.dt_bias = randn(h, k, dtype=torch.float32, s=0.5)
        self.o_norm_weight = randn(k, s=0.3, shift=1.0)
        if layout == "hkv":
            self.recurrent = 0.1 * torch.randn(rows, h, k, k, device=device, generator=gen)
        else:                                                   # V-major rows, viewed as [rows, H, K, V]
            self.recurrent = (0.1 * torch.randn(rows, h, k, k, device=device, generator=gen)).transpose(-1, -2)
        self.conv_state = randn(rows, c, CONV_WIDTH - 1)
        self.state_indices = torch.randperm(rows, device=device, generator=gen)[:n].int()


def step_inputs(n: int, h: int, k: int, device: str, gen: torch.Generator) -> tuple:
    """qkv [N, 3HK], f [N, H, K], b [N, H], out_gate [N, H, K]: bf16, fresh random."""
    r = lambda *s: torch.randn(s, device=device, generator=gen).bfloat16()  # noqa: E731
    return r(n, 3 * h * k), r(n, h, k), r(n, h), r(n, h, k)


def k3_step(kernel, layer: Layer, inputs: tuple, fresh: torch.Tensor, **kw) -> torch.Tensor:
    qkv, f, b, gate = inputs
    return kernel(qkv, layer.conv_weight, f, layer.A_log, layer.dt_bias, b, gate, layer.o_norm_weight,
                  layer.recurrent, layer.conv_state, layer.state_indices, fresh, lower_bound=LOWER_BOUND,
                  norm_eps=NORM_EPS, **kw)


def check(kernel, n: int, h: int, k: int, layout: str, device: str, seed: int) -> dict:
    """Two steps of k3's kernel against the float64 reference; rows nobody owns are NaN."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mine = Layer(n, h, k, layout, device, gen)
    owned = torch.zeros(mine.recurrent.shape[0], dtype=torch.bool, device=device)
    owned[mine.state_indices.long()] = True
    mine.recurrent[~owned] = float("nan")
    mine.conv_state[~owned] = float("nan")
    oracle_rec, oracle_conv = mine.recurrent.double(), mine.conv_state.double()
    worst = {"o": 0.0, "state": 0.0, "conv_window": 0.0}
    for step in range(2):
        inputs = step_inputs(n, h, k, device, gen)
        fresh = (torch.arange(n, device=device) % 3 == 0) & (step == 0)
        got = k3_step(kernel, mine, inputs, fresh)
        qkv, f, b, gate = (x.double() for x in inputs)
        want = torch_kda_decode.kda_decode_step(qkv, mine.conv_weight.double(), f, mine.A_log.double(), mine.dt_bias.double(),
                                   b, gate, mine.o_norm_weight.double(), oracle_rec, oracle_conv,
                                   mine.state_indices, fresh, lower_bound=LOWER_BOUND, norm_eps=NORM_EPS)
        worst["o"] = max(worst["o"], ratio(got, want))
        worst["state"] = max(worst["state"], ratio(mine.recurrent[owned], oracle_rec[owned]))
        worst["conv_window"] = max(worst["conv_window"], ratio(mine.conv_state[owned], oracle_conv[owned]))
    untouched = bool(mine.recurrent[~owned].isnan().all() and mine.conv_state[~owned].isnan().all())
    finite = bool(mine.recurrent[owned].isfinite().all())
    ok = worst["o"] < 2e-2 and worst["state"] < 1e-2 and worst["conv_window"] < 1e-2 and untouched and finite
    return {**{f"error_ratio_{key}": v for key, v in worst.items()}, "foreign_rows_untouched": untouched,
            "passed": ok}


def min_bytes(n: int, h: int, k: int) -> int:
    """State rows read + written (fp32), conv windows read + written, qkv, f, gate, o, b (bf16)."""
    c = 3 * h * k
    return 2 * n * h * k * k * 4 + 2 * n * c * (CONV_WIDTH - 1) * 2 + n * (c + 3 * h * k + h) * 2


def timed(calls, rep_ms: int, graph: bool) -> float:
    """Per-call median time (ms) of running `calls` (one per layer) back to back."""
    def run_all():
        for call in calls:
            call()

    if graph:
        return graph_replay_ms(run_all, rep_ms) / len(calls)
    run_all()
    torch.cuda.synchronize()
    return bench_ms(run_all, rep_ms) / len(calls)


def fla_peer(layers: list[Layer], inputs: tuple, h: int, k: int, layout: str):
    """fla-core's serving-mode recurrence over the same rows, on post-conv q, k, v."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    qkv, f, b, _ = inputs
    n = qkv.shape[0]
    q, kk, v = (x.reshape(n, 1, h, k).contiguous() for x in qkv.reshape(n, 3, h, k).unbind(1))
    calls = []
    for layer in layers:
        # FLA wants a contiguous [rows, H, K, V] (or V-first [rows, H, V, K]) state tensor
        state = layer.recurrent if layout == "hkv" else layer.recurrent.transpose(-1, -2)
        assert state.is_contiguous()
        calls.append(lambda layer=layer, state=state: fused_recurrent_kda_fwd(
            q, kk, v, f.reshape(n, 1, h, k), b.reshape(n, 1, h), A_log=layer.A_log, dt_bias=layer.dt_bias.reshape(-1),
            initial_state=state, inplace_final_state=True, state_v_first=layout == "hvk",
            ssm_state_indices=layer.state_indices.long(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND))
    return calls


def measure(kernel, n: int, h: int, k: int, layout: str, copy_GBps: float, rep_ms: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1000 + n)
    per_layer = 2 * n * h * k * k * 4
    n_layers = max(2, min(64, math.ceil((512 << 20) / per_layer)))      # >= 512 MiB of state touched
    layers = [Layer(n, h, k, layout, "cuda", gen) for _ in range(n_layers)]
    inputs = step_inputs(n, h, k, "cuda", gen)
    fresh = torch.zeros(n, dtype=torch.bool, device="cuda")
    floor_ms = min_bytes(n, h, k) / copy_GBps / 1e6
    out = {"layers_rotated": n_layers, "min_bytes": min_bytes(n, h, k), "floor_ms": floor_ms}
    # (warps, state row first, columns per tile): the whole-row kernel measured before, and the
    # column-blocked tiles that ptxas compiles without spills (bench/ptxas_report.py)
    for warps, first, block_v in ((4, True, None), (4, False, None), (4, None, 32), (4, None, 16), (8, None, 32),
                                  (8, None, 16)):
        variant = functools.partial(kernel, num_warps=warps, state_first=first, block_v=block_v)
        name = f"k3_fused_w{warps}" + ("_statefirst" if first else "") + (f"_bv{block_v}" if block_v else "")
        verdict = check(variant, 4, h, k, layout, "cuda", seed=7)             # every variant, before timing
        out[f"{name}_check"] = verdict
        if not verdict["passed"]:
            continue
        calls = [lambda layer=layer: k3_step(variant, layer, inputs, fresh) for layer in layers]
        for graph in (False, True):
            ms = timed(calls, rep_ms, graph)
            out[f"{name}_{'graph' if graph else 'eager'}_us"] = ms * 1e3
    graphs = {key[: -len("_graph_us")]: v for key, v in out.items() if key.startswith("k3_fused") and key.endswith("graph_us")}
    out["k3_fused_best_variant"] = min(graphs, key=graphs.get)
    out["k3_fused_best_graph_us"] = graphs[out["k3_fused_best_variant"]]
    # the kernel's defaults: 4 warps; state row loaded first when V is contiguous ("hkv")
    default = "k3_fused_w4_statefirst" if layout == "hkv" else "k3_fused_w4"
    out["k3_fused_default_graph_us"] = out[f"{default}_graph_us"]
    out["k3_fused_default_eager_us"] = out[f"{default}_eager_us"]
    out["k3_fused_default_fraction_of_copy_bw"] = floor_ms * 1e3 / out["k3_fused_default_graph_us"]
    try:
        calls = fla_peer(layers, inputs, h, k, layout)
        out["fla_recurrent_eager_us"] = timed(calls, rep_ms, False) * 1e3
        out["fla_recurrent_graph_us"] = timed(calls, rep_ms, True) * 1e3
        out["k3_fused_vs_fla_speedup"] = out["fla_recurrent_graph_us"] / out["k3_fused_default_graph_us"]
    except Exception as e:  # report, don't hide
        out["fla_error"] = f"{type(e).__name__}: {e}"
    calls = [lambda layer=layer: k3_step(torch_kda_decode.kda_decode_step, layer, inputs, fresh) for layer in layers[:4]]
    out["reference_eager_us"] = timed(calls, rep_ms, False) * 1e3
    out["k3_fused_vs_reference_speedup"] = out["reference_eager_us"] / out["k3_fused_default_graph_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kda_decode.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--layouts", nargs="+", default=["hkv", "hvk"], choices=["hkv", "hvk"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    args = parser.parse_args()
    from k3.platforms.triton_kernels.kda_decode import kda_decode_step as kernel

    if args.smoke:
        for layout in ("hkv", "hvk"):
            result = check(kernel, 3, 2, 16, layout, "cpu", seed=0)
            print(layout, result)
            assert result["passed"], result
        return
    h, k = 96, 128
    props = torch.cuda.get_device_properties(0)
    result = {"date": datetime.date.today().isoformat(), "device": props.name, "torch": torch.__version__,
              "shape": f"H{h} K=V{k} conv{CONV_WIDTH} bf16 activations, fp32 state"}
    import triton

    result["triton"] = triton.__version__
    try:
        import fla

        result["fla"] = getattr(fla, "__version__", "unknown")
    except ImportError as e:
        result["fla"] = f"not importable: {e}"
    result["copy_GBps"] = copy_bw = copy_bandwidth_GBps()
    rows = []
    for layout in args.layouts:
        for n in args.batch:
            key = f"{layout}_N{n}"
            entry = {"check": check(kernel, n, h, k, layout, "cuda", seed=n)}
            if entry["check"]["passed"]:
                entry.update(measure(kernel, n, h, k, layout, copy_bw, args.rep_ms))
            result[key] = entry
            torch.cuda.empty_cache()
            rows.append((key, entry))
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    print(f"copy bandwidth {copy_bw:.0f} GB/s; per-layer step, microseconds")
    print(f"{'case':<12} {'ok':<3} {'k3 graph':>9} {'k3 eager':>9} {'fla graph':>9} {'ref eager':>9} "
          f"{'floor':>7} {'%copy':>6} {'vs fla':>7}  best variant (graph us)")
    for key, e in rows:
        if "floor_ms" not in e:
            print(f"{key:<12} FAIL {e['check']}")
            continue
        print(f"{key:<12} {'ok':<3} {e['k3_fused_default_graph_us']:9.1f} {e['k3_fused_default_eager_us']:9.1f} "
              f"{e.get('fla_recurrent_graph_us', float('nan')):9.1f} {e['reference_eager_us']:9.1f} "
              f"{e['floor_ms'] * 1e3:7.1f} {100 * e['k3_fused_default_fraction_of_copy_bw']:5.0f}% "
              f"{e.get('k3_fused_vs_fla_speedup', float('nan')):6.2f}x  {e['k3_fused_best_variant']} "
              f"({e['k3_fused_best_graph_us']:.1f})")


if __name__ == "__main__":
    main()
