"""Chunked KDA prefill on the nvidia platform (k3's wrapper over fla-core's `chunk_kda`, with
prefix-cache checkpoints emitted in the same pass) against fla-core called directly and the
torch reference, at K3 per-layer shapes (96 heads, K = V = 128, bf16 q/k/v, fp32 gates and
state), in one call on the GPU.

    python3 bench/kda_prefill.py --out kda_prefill.json

k3's wrapper gives fla-core fp32 q / k / v by default (TF32 dots and fp32 per-chunk states,
`kda_chunked.operand_dtype`); each case also times and checks it on bf16 operands, and k3's own
chunked prefill: the batched torch kernel (`torch_kernels/kda_chunked_blocked.py`, experimental
`kda_chunked_torch`, `torch_batched_ms`), the sixth session's served form (torch phase 1 with the
Triton diagonal, Triton recurrence: `torch_batched_triton_ms`) and both phases in Triton
(`triton_kernels/kda_chunked_blocked.py`): served (`triton_phases_ms`: phase 1 in fp32 FMAs, the
recurrence in 3xTF32), both in fp32 FMAs (`triton_phases_ieee_ms`), both in 3xTF32
(`triton_phases_tf32x3_ms`) and phase 1's whole-chunk tensor-core form (`intra_chunk(form="mma")`,
3xTF32) with the served recurrence (`triton_phases_mma_ms`), and both with o scattered to the
token rows and cast after the recurrence (`triton_phases_o_scatter_ms`,
`triton_phases_mma_o_scatter_ms`; served until 2026-12-06, when the recurrence began storing o
to its rows itself; files of that day's first run name the other pair `_o_index`). The 8K
case without checkpoints also times each phase's launch variants inside a whole prefill
(`phase_ms`: CUDA events around the phase, medians of 10; `intra_mma_*` the mma form's,
`intra_split_*` the split form's (`triton_phases_split_ms` its whole prefill), `rec_split_*` phase
2 split in two launches (kda_chunked_state.recurrence_split; `triton_phases_state_split_ms` its
whole prefill, o stored to the rows), `whole` / `whole_mma` / `whole_split` / `whole_state_split`
the prefill with each form; `phase_error_ratio_final_state`: each pair's check).

Cases: one 8,192-token prompt without checkpoints, the same with the checkpoint prefix caching
keeps at its last full 512-token unit (7,680) and at 4,096; four ragged prompts (3,000, 2,048,
1,000, 2,144 tokens) with per-sequence checkpoints. Each is checked against the reference on
the same fresh random inputs (error ratio of o, final state and checkpoints) before timing.
Times are medians of CUDA-event timings (triton.testing.do_bench); the floor is the fewest
bytes (inputs read once, o and states written once) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import datetime
import json
import os
import statistics
from unittest import mock

import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked as torch_chunked  # the reference platform's kernel
from measure import bench_ms, copy_bandwidth_GBps, ratio


def make(lens, h=96, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lens)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q = ref.l2_norm(rnd(1, t, h, d)).bfloat16()
    k = ref.l2_norm(rnd(1, t, h, d)).bfloat16()
    v = rnd(1, t, h, d).bfloat16()
    gate = -5.0 * torch.sigmoid(rnd(1, t, h, d) * 1.5)
    beta = torch.sigmoid(rnd(1, t, h))
    s0 = 0.1 * rnd(len(lens), h, d, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return (q, k, v, gate, beta), {"initial_state": s0, "cu_seqlens": cu}


def run_case(name, lens, offsets, copy_GBps) -> dict:
    from fla.ops.kda import chunk_kda

    from k3.platforms.triton_kernels.kda_chunked import OPERANDS_ENV, kda_chunked

    args, kw = make(lens)
    emit = {} if offsets is None else {"checkpoint_offsets": offsets}
    got = kda_chunked(*args, **kw, **emit)
    # the float64 reference (the reference platform's WY kernel on float64 inputs and states)
    want = torch_chunked.kda_chunked(*(a.double() for a in args), **emit,
                                     **{n: t.double() if t.is_floating_point() else t for n, t in kw.items()})
    out = {"lens": lens, "offsets": offsets if not isinstance(offsets, torch.Tensor) else offsets.tolist(),
           "error_ratio_o": ratio(got.o, want.o), "error_ratio_final_state": ratio(got.state, want.state)}
    if offsets is not None:
        out["error_ratio_checkpoints"] = max(ratio(a, b) for a, b in zip(got.checkpoints, want.checkpoints))
    out["passed"] = all(v < 2e-2 for key, v in out.items() if key.startswith("error_ratio"))
    out["k3_ms"] = bench_ms(lambda: kda_chunked(*args, **kw, **emit))
    with mock.patch.dict(os.environ, {OPERANDS_ENV: "bf16"}):     # fla-core on the model's bf16 operands
        bf16 = kda_chunked(*args, **kw, **emit)
        out["error_ratio_o_bf16_operands"] = ratio(bf16.o, want.o)
        out["k3_bf16_operands_ms"] = bench_ms(lambda: kda_chunked(*args, **kw, **emit))
    out["fla_direct_no_checkpoints_ms"] = bench_ms(
        lambda: chunk_kda(*args, initial_state=kw["initial_state"], output_final_state=True,
                          cu_seqlens=kw["cu_seqlens"]))
    out["reference_ms"] = bench_ms(lambda: torch_chunked.kda_chunked(*args, **kw, **emit), rep_ms=1000)
    # the batched torch kernel (experimental kda_chunked_torch): exact fp32, every chunk at once
    from k3.platforms.torch_kernels.kda_chunked_blocked import kda_chunked as torch_batched

    batched = torch_batched(*args, **kw, **emit)
    out["error_ratio_o_torch_batched"] = ratio(batched.o, want.o)
    out["error_ratio_final_state_torch_batched"] = ratio(batched.state, want.state)
    out["torch_batched_ms"] = bench_ms(lambda: torch_batched(*args, **kw, **emit), rep_ms=1000)
    out["torch_batched_vs_reference_speedup"] = out["reference_ms"] / out["torch_batched_ms"]
    # the same with its diagonal blocks in Triton, the recurrence still the torch loop (one round
    # of batched matmuls per chunk index), then the wrapper (triton_kernels/kda_chunked_blocked.py),
    # which also runs the recurrence in one Triton launch; all exact fp32
    from k3.platforms.triton_kernels import kda_chunked_blocked as triton_blocked
    from k3.platforms.triton_kernels import kda_chunked_recurrence as triton_recurrence

    from k3.platforms.triton_kernels import kda_intra_chunk as triton_intra

    def phases(intra_precision, rec_precision, **rec_launch):
        return lambda: torch_batched(
            *args, **kw, **emit, intra=functools.partial(triton_intra.intra_chunk, precision=intra_precision),
            recurrence=functools.partial(triton_recurrence.recurrence, precision=rec_precision, **rec_launch))

    variants = {"torch_batched_triton": lambda: triton_blocked.kda_chunked_triton_diagonal(*args, **kw, **emit),
                # both phases in Triton, served: phase 1 in fp32 FMAs, the recurrence in 3xTF32 tensor-core
                # dots (bench/kda_tf32_sensitivity.py: as accurate as fp32) with its state in registers;
                # then both phases in fp32 FMAs, and both in 3xTF32
                "triton_phases": lambda: triton_blocked.kda_chunked(*args, **kw, **emit),
                "triton_phases_ieee": phases("ieee", "ieee"),
                "triton_phases_tf32x3": phases("tf32x3", "tf32x3"),
                # phase 1 as whole-chunk 3xTF32 tensor-core dots (kda_intra_chunk's "mma" form), recurrence served
                "triton_phases_mma": lambda: triton_blocked.kda_chunked_mma(*args, **kw, **emit),
                # phase 1 in three kernels with wide grids (kda_intra_split), recurrence served
                "triton_phases_split": lambda: triton_blocked.kda_chunked_split(*args, **kw, **emit),
                # phase 1 served, the recurrence split in two launches (kda_chunked_state: the state kernel,
                # then the output product, o stored to the token rows)
                "triton_phases_state_split": lambda: triton_blocked.kda_chunked_state_split(*args, **kw, **emit),
                # the served form and the mma one with o scattered to the token rows and cast after the
                # recurrence (the served form until 2026-12-06) instead of stored there by the recurrence
                "triton_phases_o_scatter": lambda: triton_blocked.kda_chunked(*args, **kw, **emit,
                                                                              o_through_index=False),
                "triton_phases_mma_o_scatter": lambda: triton_blocked.kda_chunked(*args, **kw, **emit,
                                                                                  intra_form="mma",
                                                                                  o_through_index=False)}
    if len(lens) == 1 and offsets is None:
        out["phase_ms"], out["phase_error_ratio_final_state"] = phase_split(
            args, kw, torch_batched, triton_intra, triton_recurrence, want)
    for key, call in variants.items():
        res = call()
        out[f"error_ratio_o_{key}"] = ratio(res.o, want.o)
        out[f"error_ratio_final_state_{key}"] = ratio(res.state, want.state)
        if offsets is not None:
            out[f"error_ratio_checkpoints_{key}"] = max(ratio(a, b) for a, b in zip(res.checkpoints, want.checkpoints))
        out[f"{key}_ms"] = bench_ms(call, rep_ms=1000)
        out[f"{key}_vs_reference_speedup"] = out["reference_ms"] / out[f"{key}_ms"]
    t, h, d = sum(lens), 96, 128
    n_states = len(lens) * (2 + (0 if offsets is None else torch.as_tensor(offsets).shape[-1]))
    nbytes = t * h * d * (2 * 3 + 4 + 2) + t * h * 4 + n_states * h * d * d * 4
    out["floor_ms"] = nbytes / copy_GBps / 1e6
    out["k3_vs_reference_speedup"] = out["reference_ms"] / out["k3_ms"]
    out["k3_over_fla_direct"] = out["k3_ms"] / out["fla_direct_no_checkpoints_ms"]
    return out


def phase_split(args, kw, torch_chunked, triton_intra, triton_recurrence, want):
    """Device time of each phase's kernel variants (CUDA events around the phase inside one
    prefill, the median of 10), and of the whole prefill: what the rest (input copies, index
    building, the output scatter) costs is the difference. Returns (the times, each pair's
    final-state error ratio against `want`)."""
    timings, errors = {}, {}

    def timed(name, fn):
        def call(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            res = fn(*a, **k)
            end.record()
            end.synchronize()
            timings.setdefault(name, []).append(start.elapsed_time(end))
            return res
        return call

    from k3.platforms.triton_kernels import kda_intra_split as triton_intra_split

    P = functools.partial
    intras = {"intra_ieee": P(triton_intra.intra_chunk, precision="ieee"),          # served: 4 warps, slices of 16
              "intra_tf32x3": P(triton_intra.intra_chunk, precision="tf32x3"),
              "intra_ieee_rows_inverse": P(triton_intra.intra_chunk, neumann=False),
              "intra_ieee_w8_s32": P(triton_intra.intra_chunk, num_warps=8, slice_=32),
              "intra_ieee_diag32": P(triton_intra.intra_chunk, diag_slice=32),
              # the whole-chunk tensor-core form (3xTF32): [64, slice] tiles, warps
              "intra_mma_s64_w4": P(triton_intra.intra_chunk, form="mma"),
              "intra_mma_s32_w4": P(triton_intra.intra_chunk, form="mma", slice_=32),
              "intra_mma_s64_w8": P(triton_intra.intra_chunk, form="mma", num_warps=8),
              "intra_mma_s32_w8": P(triton_intra.intra_chunk, form="mma", slice_=32, num_warps=8),
              # the split form (kda_intra_split: three kernels, wide grids): 3xTF32 wide dots, or fp32 FMAs;
              # warps; 32 key channels a step in its first launch
              "intra_split_w4": P(triton_intra.intra_chunk, form="split"),
              "intra_split_ieee_w4": P(triton_intra.intra_chunk, form="split", precision="ieee"),
              "intra_split_w8": P(triton_intra.intra_chunk, form="split", num_warps=8),
              "intra_split_s32_w4": P(triton_intra.intra_chunk, form="split", slice_=32),
              "intra_split_c32_w4": P(triton_intra_split.intra_chunk_split, w_slice=32)}   # W, U: 32 columns
    recs = {"recurrence_ieee": P(triton_recurrence.recurrence, precision="ieee"),
            "recurrence_tf32x3_bv16_w4": P(triton_recurrence.recurrence, precision="tf32x3", block_v=16),
            "recurrence_tf32x3_bv32_w4": P(triton_recurrence.recurrence, precision="tf32x3", block_v=32)}
    # phase 2 split (kda_chunked_state.recurrence_split: the state kernel, then the output product), 3xTF32:
    # the state kernel's columns, warps, chunk prefetch (s1: none, held to 168 registers); the output's columns
    from k3.platforms.triton_kernels import kda_chunked_state as triton_state

    split = P(triton_state.recurrence_split, precision="tf32x3")
    recs.update({"rec_split_bv64_w4": split,                                       # its default launch
                 "rec_split_bv64_w4_out32": P(split, out_block_v=32),
                 "rec_split_bv32_w4": P(split, block_v=32),
                 "rec_split_bv32_w4_s1_r168": P(split, block_v=32, num_stages=1, max_registers=168)})
    pairs = [(name, "recurrence_tf32x3_bv32_w4") for name in intras]
    pairs += [("intra_ieee", "recurrence_ieee"), ("intra_ieee", "recurrence_tf32x3_bv16_w4")]
    pairs += [("intra_ieee", name) for name in recs if name.startswith("rec_split")]
    for iname, rname in pairs:
        for _ in range(11):
            res = torch_chunked(*args, **kw, intra=timed(iname, intras[iname]), recurrence=timed(rname, recs[rname]))
        errors[f"{iname}+{rname}"] = ratio(res.state, want.state)
    for name, iname, rname in (("whole", "intra_ieee", "recurrence_tf32x3_bv32_w4"),
                               ("whole_mma", "intra_mma_s64_w4", "recurrence_tf32x3_bv32_w4"),
                               ("whole_split", "intra_split_w4", "recurrence_tf32x3_bv32_w4"),
                               ("whole_state_split", "intra_ieee", "rec_split_bv64_w4")):
        whole = timed(name, lambda iname=iname, rname=rname: torch_chunked(*args, **kw, intra=intras[iname],
                                                                           recurrence=recs[rname]))
        for _ in range(11):
            whole()
    return {name: statistics.median(ms[1:]) for name, ms in timings.items()}, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="kda_prefill.json")
    args = parser.parse_args()
    import fla
    import triton

    copy_GBps = copy_bandwidth_GBps()
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch":
              torch.__version__, "triton": triton.__version__, "fla": getattr(fla, "__version__", "?"),
              "copy_GBps": copy_GBps}
    ragged = [3000, 2048, 1000, 2144]
    cases = {
        "T8192_no_checkpoints": ([8192], None),
        "T8192_checkpoints_4096_7680": ([8192], [4096, 7680]),
        "ragged4_T8192_checkpoints": (ragged, torch.tensor([[2560, 512], [1536, 1536], [512, 0], [2048, 1024]])),
    }
    for name, (lens, offsets) in cases.items():
        try:
            result[name] = run_case(name, lens, offsets, copy_GBps)
        except Exception as e:   # report, don't hide
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"copy bandwidth {copy_GBps:.0f} GB/s")
    print(f"{'case':<30} {'ok':<4} {'k3 ms':>8} {'fla ms':>8} {'ref ms':>8} {'floor':>7} {'vs ref':>7} {'err o':>8}")
    for name in cases:
        e = result[name]
        if "error" in e:
            print(f"{name:<30} ERROR {e['error']}")
            continue
        print(f"{name:<30} {'ok' if e['passed'] else 'FAIL':<4} {e['k3_ms']:8.2f} {e['fla_direct_no_checkpoints_ms']:8.2f} "
              f"{e['reference_ms']:8.1f} {e['floor_ms']:7.3f} {e['k3_vs_reference_speedup']:6.0f}x "
              f"{e['error_ratio_o']:8.1e}")
    forms = ("triton_phases", "triton_phases_mma", "triton_phases_split", "triton_phases_o_scatter",
             "triton_phases_mma_o_scatter")
    print(f"{'Triton phases (ms, state err)':<30} " + " ".join(f"{f[14:] or 'served':>22}" for f in forms))
    for name in cases:
        e = result[name]
        if "error" not in e:
            print(f"{name:<30} " + " ".join(f"{e[f + '_ms']:10.2f} {e['error_ratio_final_state_' + f]:11.1e}"
                                            for f in forms))
    for key, ms in result.get("T8192_no_checkpoints", {}).get("phase_ms", {}).items():
        print(f"  {key:<28} {ms:8.2f} ms")


if __name__ == "__main__":
    main()
