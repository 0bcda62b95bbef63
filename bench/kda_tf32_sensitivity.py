"""Which part of k3's chunked KDA prefill may multiply in TF32 (or bf16) without moving the tiny
models' greedy tokens off the float64 oracle? CPU emulation, no GPU needed.

    python bench/kda_tf32_sensitivity.py --out bench/results/kda_tf32_sensitivity-cpu-2026-11-30.json

Background: fla-core's chunk_kda fails k3-tiny's bf16 `model.greedy` (one token leaves the
float64 oracle's at an oracle gap of 4.03, margin 4) because all its dots run in TF32 (final
state error ratio 7.9e-4 at K3 shapes); with 3xTF32 dots it passes. k3 serves an exact fp32
implementation (platforms/torch_kernels/kda_chunked_blocked.py) in two phases:

  phase 1 (`_intra_chunk`, every chunk at once): the decay-weighted products A_kk = k e^(G_i-G_j) k
     and A_qk = q e^(G_i-G_j) k (off-diagonal 16-blocks: one matmul each; diagonal 16-blocks:
     elementwise, exact pairwise decays), the unit lower-triangular solve (I + L) X = rhs of the
     WY/UT form and W, U;
  phase 2 (`recurrence_torch`): the cross-chunk state chain, per chunk
     delta = U - W S,  o = qeG S + A_qk delta,  S = e^(G_C) * S + kdec^T delta.

A fast Triton kernel will want tensor-core dots. This script measures which phase tolerates them.

Method. Each variant is `kda_chunked_blocked.kda_chunked` with the matmuls of one phase run on
rounded operands and fp32 accumulation, as a tensor core does:
  - TF32: each fp32 operand rounded to a 10-bit mantissa, round to nearest with ties away from
    zero (PTX cvt.rna.tf32.f32): add 0x1000 (half an ulp of bit 13) to the fp32 bit pattern and
    clear the low 13 bits. Working on the sign-magnitude bit pattern rounds the magnitude, so
    negative numbers round symmetrically; inf / nan pass through. A product of two TF32 values is
    exact in fp32, so a CPU fp32 matmul of the rounded operands is a tensor core's TF32 dot up to
    the accumulation order.
  - bf16: each operand rounded to bf16 (round to nearest even) and back to fp32.
  - 3xTF32 (control): a = hi + lo with hi = tf32(a), lo = tf32(a - hi); a b ~ hi hi + hi lo + lo hi.
Phase 2 is swapped through `kda_chunked(recurrence=...)`: a copy of `recurrence_torch` whose
baddbmm / bmm round their matrix operands (W, S, qeG, A_qk, delta, kdec; the state is still held,
decayed and accumulated in fp32). Phase 1 is swapped by patching the module attribute
`kda_chunked_blocked._intra_chunk` for the duration of the call with a copy whose off-diagonal
A_kk / A_qk matmuls round their operands (the already-scaled k e^(G - G_r), q e^(G - G_r) and
k e^(G_r - G)), and whose solve is what a Triton kernel does: the 16x16 diagonal blocks of
(I + L)^-1 inverted exactly in fp32 (forward substitution), the off-diagonal blocks merged with
rounded-operand matmuls (X_ij = -X_ii sum_k L_ik X_kj), then W, U = X @ (beta e^G k, beta v) with
rounded operands. The diagonal blocks of A_kk / A_qk stay elementwise and exact: they have no
matmul (a Triton kernel computes them with exact pairwise decays on CUDA cores too). Phase 1's
outputs (W, U, A_qk, qeG, kdec) stay fp32 (the rounding happens where phase 2 uses them, if at all).

Variants: exact (the served fp32 kernel); a = TF32 phase 1 only; b = TF32 phase 2 only;
c = TF32 both (fla-like); d = bf16 operands in phase 1 only; e = 3xTF32 both (control);
f / g / h = 3xbf16 (`mm_bf16x3`: bf16 hi / lo splits, three bf16 products, what a kernel would
run at half 3xTF32's tensor-core cost) in both phases / phase 1 only / phase 2 only (the other
phase 3xTF32);
and at kernel level `exact-copy` (the phase-1 copy with exact matmuls: the blocked inverse's own
fp32 rounding, a sanity check).

Kernel level: random K3-like inputs (bf16-valued l2-normalised q / k and v, K3's gate
g = -5 sigmoid(a x) with per-channel biases so that |g| spans ~0.005-4.5, beta = sigmoid, a
random initial state, one 2048-token sequence and a ragged batch), error ratios
||x - ref|| / ||ref|| of o and of the final state against the float64 reference
(`k3.reference.kda_chunked` on the same values in float64).

Model level: the conformance `model.greedy` items of the three tiny presets in bf16 and fp32 on
the reference platform on the CPU, every op the reference's except `kda.chunked`, replaced by the
variant (what tests/kernels/kernel_tables.py's `run_with(item, "kda", chunked=fn)` does; ~0.4 s a
run with one torch thread, ~2.5 min in all on a 2-core CPU shared with a CI run). One RunContext is shared by all variants (the
same-dtype reference and float64 oracle traces are computed once; the variant is picked by a
dispatcher installed as `kda.chunked`). Per variant and case: passed, the outcome's summary, and
every step where the variant's token differs from the oracle's (and from the same-dtype
reference's) with the oracle's top-1 / top-2 gap there, including near-ties below the margin:
`max_flip_gap` is the smallest margin at which the case would still pass (on tokens; the case
also checks the logits' error ratio against the oracle and the same-dtype reference). Resampling: the
TF32 / bf16 variants are also run with `--draws` independent draws of the same rounding (each
operand scaled by a random s in [1, 2) before rounding and unscaled after: `dithered`), since
one deterministic rounding is one draw of a chaotic bf16 tiny model's response. Controls:
`noise<eps>`, the exact kernel with o and the final state perturbed by relative Gaussian noise
eps (1e-6 .. 3e-4; TF32's kernel-level error is ~3e-4), `--noise-draws` draws each: which error
size the case tolerates whatever its source.

Findings (CPU, 2026-11-30, bench/results/kda_tf32_sensitivity-cpu-2026-11-30.json): TF32 in
phase 1 alone gives a final-state error ratio of 2.1e-4, in phase 2 alone 2.9e-4, in both 3.7e-4
(the two add in quadrature; 3xTF32 3.8e-7 = exact). Neither split passes: every fp32 model case
fails with TF32 in either phase (logits 1e-4 .. 1e-2 against a 1.5x-reference + 1e-5 bound; noise
1e-5 already fails k3-tiny), and the bf16 cases become a draw at TF32's error size (a, b, c, d
pass 13 / 14 / 11 / 17 of 27 runs; 3e-4 noise 17 / 24), while noise <= 1e-5 passes all 24.
The budget for a fast kernel is ~1e-6 relative (fp32 models), ~1e-5 (bf16), in both phases.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform as host
import time
from pathlib import Path
from unittest import mock

import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import kda_chunked as torch_chunked  # the reference platform's kernel
from k3.platforms.torch_kernels import kda_chunked_blocked as blocked

BLOCK = blocked.BLOCK


# ---------------------------------------------------------------- operand rounding and matmuls

def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest TF32 value (10-bit mantissa), ties away from zero, as cvt.rna.tf32.f32."""
    assert x.dtype == torch.float32
    bits = x.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)         # -0x2000 == 0xFFFFE000
    return torch.where(torch.isfinite(x), rounded, x)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def mm_exact(a, b):
    return torch.matmul(a, b)


def mm_tf32(a, b):
    return torch.matmul(round_tf32(a), round_tf32(b))


def mm_bf16(a, b):
    return torch.matmul(round_bf16(a), round_bf16(b))


def dithered(rounder, seed):
    """A matmul whose operands are rounded by `rounder` after scaling each by a random factor
    s in [1, 2) (and back: a' = rounder(a s) / s, exact up to one fp32 rounding): a rounding
    error of the same size and distribution as `rounder`'s but an independent draw, so that a
    variant's model-level pass / fail can be resampled."""
    gen = torch.Generator().manual_seed(seed)

    def mm(a, b):
        sa, sb = (1.0 + torch.rand((), generator=gen).item() for _ in range(2))
        return torch.matmul(rounder(a * sa) / sa, rounder(b * sb) / sb)

    return mm


def mm_tf32x3(a, b):
    ah, bh = round_tf32(a), round_tf32(b)
    al, bl = round_tf32(a - ah), round_tf32(b - bh)
    return torch.matmul(ah, bh) + (torch.matmul(ah, bl) + torch.matmul(al, bh))


def mm_bf16x3(a, b):
    """Three bf16 tensor-core products: a = hi + lo with hi = bf16(a), lo = bf16(a - hi) (16
    significand bits of a's 24), a b ~ hi hi + hi lo + lo hi, each product exact in fp32 and
    accumulated in fp32. Half the tensor-core cycles of 3xTF32 on an H100 / H200 (bf16 runs at
    twice TF32's rate) and half its operand registers, at ~2^-16 relative error a product
    against 3xTF32's ~2^-21."""
    ah, bh = round_bf16(a), round_bf16(b)
    al, bl = round_bf16(a - ah), round_bf16(b - bh)
    return torch.matmul(ah, bh) + (torch.matmul(ah, bl) + torch.matmul(al, bh))


def dithered_split(mm, seed):
    """`dithered` for a split product (mm_bf16x3): both operands scaled by random s in [1, 2)
    before the split and the product scaled back, an independent draw of its rounding errors."""
    gen = torch.Generator().manual_seed(seed)

    def dithered_mm(a, b):
        sa, sb = (1.0 + torch.rand((), generator=gen).item() for _ in range(2))
        return mm(a * sa, b * sb) / (sa * sb)

    return dithered_mm


# ---------------------------------------------------------------- phase 1 with rounded matmuls

def blocked_inverse(IL: torch.Tensor, mm) -> torch.Tensor:
    """(I + L)^-1 of unit lower-triangular [.., C, C]: exact fp32 16x16 diagonal blocks, the
    off-diagonal blocks merged with `mm` (X_ij = -X_ii sum_{j <= k < i} M_ik X_kj)."""
    C = IL.shape[-1]
    nb = (C + BLOCK - 1) // BLOCK
    sl = [slice(b * BLOCK, min((b + 1) * BLOCK, C)) for b in range(nb)]
    X = torch.zeros_like(IL)
    for i in range(nb):
        d = IL[..., sl[i], sl[i]]
        eye = torch.eye(d.shape[-1], dtype=IL.dtype)
        X[..., sl[i], sl[i]] = torch.linalg.solve_triangular(d, eye.expand_as(d), upper=False, unitriangular=True)
    for i in range(nb):
        for j in range(i):
            acc = sum(mm(IL[..., sl[i], sl[k]], X[..., sl[k], sl[j]]) for k in range(j, i))
            X[..., sl[i], sl[j]] = -mm(X[..., sl[i], sl[i]], acc)
    return X


def make_intra(mm):
    """A copy of `kda_chunked_blocked._intra_chunk` whose matmuls (off-diagonal A blocks, the
    inverse's merges, W and U) are `mm`; the diagonal blocks are the unchanged exact ones."""

    def intra(q, k, v, g, beta, diagonal=blocked.diagonal_blocks_torch):
        S, HV, C, K = q.shape
        G = g.cumsum(2)
        A_kk = q.new_zeros(S, HV, C, C)
        A_qk = q.new_zeros(S, HV, C, C)
        diagonal(q, k, G, A_kk, A_qk, block=BLOCK)
        for b0 in range(0, C, BLOCK):
            jb = slice(b0, min(b0 + BLOCK, C))
            Gj = G[:, :, jb]
            kj = k[:, :, jb]
            if jb.stop < C:
                Gr = Gj[:, :, -1:]
                right = (kj * torch.exp(Gr - Gj)).transpose(-1, -2)
                rows = slice(jb.stop, C)
                left = torch.exp(G[:, :, rows] - Gr)
                A_kk[:, :, rows, jb] = mm(k[:, :, rows] * left, right)
                A_qk[:, :, rows, jb] = mm(q[:, :, rows] * left, right)
        b = beta[..., None]
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        IL = eye + (b * A_kk).tril(-1)
        eG = torch.exp(G)
        X = blocked_inverse(IL, mm)
        WU = mm(X, b * torch.cat([eG * k, v], dim=-1))
        W, U = WU.split([K, v.shape[-1]], dim=-1)
        GC = G[:, :, -1:]
        return W, U, A_qk.tril(), q * eG, torch.exp(GC - G) * k, torch.exp(GC)

    return intra


# ---------------------------------------------------------------- phase 2 with rounded matmuls

def make_recurrence(mm):
    """A copy of `kda_chunked_blocked.recurrence_torch` with its baddbmm / bmm as `mm` (fp32
    state held, decayed and accumulated exactly)."""

    def recurrence(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture=()):
        dev = initial.device
        nseg, HV, C, V = U.shape
        K = W.shape[-1]
        where = torch.tensor(order, device=dev)
        state = initial[where]
        o_chunks = torch.empty(nseg, HV, C, V, dtype=state.dtype, device=dev)
        captured = torch.empty(len(capture), HV, K, V, dtype=state.dtype, device=dev)
        slot = {s: i for i, s in enumerate(capture)}
        s0 = 0
        for size in sizes:
            segs = slice(s0, s0 + size)
            S0 = state[:size].clone()
            delta = U[segs] - mm(W[segs], S0)
            o_chunks[segs] = mm(qeG[segs], S0) + mm(A_qk[segs], delta)
            state[:size] = eGC[segs].transpose(-1, -2) * S0 + mm(kdec[segs].transpose(-1, -2), delta)
            for j in range(size):
                if s0 + j in slot:
                    captured[slot[s0 + j]] = state[j]
            s0 += size
        return o_chunks, state[where.argsort()], captured

    return recurrence


def make_variant(mm1, mm2, draw=0):
    """kda_chunked with phase 1's matmuls `mm1` (None: the served `_intra_chunk`) and phase 2's
    `mm2` (None: the served `recurrence_torch`). Float64 calls (the oracle's) go through unchanged.
    draw > 0: mm_tf32 / mm_bf16 replaced by their `dithered` versions, mm_bf16x3 by its
    `dithered_split` one (seeds from draw)."""
    if draw:
        redo = {mm_tf32: round_tf32, mm_bf16: round_bf16}
        mm1 = dithered(redo[mm1], 1000 * draw + 1) if mm1 in redo else mm1
        mm2 = dithered(redo[mm2], 1000 * draw + 2) if mm2 in redo else mm2
        mm1 = dithered_split(mm1, 1000 * draw + 3) if mm1 is mm_bf16x3 else mm1
        mm2 = dithered_split(mm2, 1000 * draw + 4) if mm2 is mm_bf16x3 else mm2
    intra = None if mm1 is None else make_intra(mm1)
    rec = None if mm2 is None else make_recurrence(mm2)

    def kda_chunked(q, k, v, g, beta, **kw):
        if q.dtype == torch.float64:
            return blocked.kda_chunked(q, k, v, g, beta, **kw)
        if intra is None:
            return blocked.kda_chunked(q, k, v, g, beta, recurrence=rec, **kw)
        with mock.patch.object(blocked, "_intra_chunk", intra):
            return blocked.kda_chunked(q, k, v, g, beta, recurrence=rec, **kw)

    return kda_chunked


def make_noise(eps, seed):
    """Control: the exact kernel with o and the final state perturbed elementwise by relative
    Gaussian noise eps (error ratio ~eps, a fresh draw every call): how the model case responds
    to an unstructured error of TF32's size."""
    gen = torch.Generator().manual_seed(seed)

    def kda_chunked(q, k, v, g, beta, **kw):
        out = blocked.kda_chunked(q, k, v, g, beta, **kw)
        if q.dtype == torch.float64:
            return out
        jitter = lambda x: x * (1 + eps * torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.dtype))  # noqa: E731
        return dataclasses.replace(out, o=jitter(out.o), state=jitter(out.state))

    return kda_chunked


VARIANTS = {
    "exact": ("served exact fp32", None, None),
    "a_tf32_phase1": ("TF32 phase 1, exact phase 2", mm_tf32, None),
    "b_tf32_phase2": ("exact phase 1, TF32 phase 2", None, mm_tf32),
    "c_tf32_both": ("TF32 both (fla-like)", mm_tf32, mm_tf32),
    "d_bf16_phase1": ("bf16 operands phase 1, exact phase 2", mm_bf16, None),
    "e_tf32x3_both": ("3xTF32 both (control)", mm_tf32x3, mm_tf32x3),
    "f_bf16x3_both": ("3xbf16 both", mm_bf16x3, mm_bf16x3),
    "g_bf16x3_phase1": ("3xbf16 phase 1, 3xTF32 phase 2", mm_bf16x3, mm_tf32x3),
    "h_bf16x3_phase2": ("3xTF32 phase 1, 3xbf16 phase 2", mm_tf32x3, mm_bf16x3),
}
DITHERED = ("a_tf32_phase1", "b_tf32_phase2", "c_tf32_both", "d_bf16_phase1", "f_bf16x3_both", "g_bf16x3_phase1",
            "h_bf16x3_phase2")
KERNEL_ONLY = {"exact_copy": ("phase-1 copy, exact matmuls (sanity)", mm_exact, mm_exact)}


# ---------------------------------------------------------------- kernel level

def kernel_inputs(lens, hv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = sum(lens)
    q = ref.l2_norm(rnd(1, t, hv, d)).bfloat16().float()
    k = ref.l2_norm(rnd(1, t, hv, d)).bfloat16().float()
    v = rnd(1, t, hv, d).bfloat16().float()
    bias = torch.empty(hv, d).uniform_(-7.0, 2.0, generator=gen)            # per-channel decay bias
    g = -5.0 * torch.sigmoid(1.5 * rnd(1, t, hv, d) + bias)                # K3's gate: |g| ~ 0.005 .. 4.5
    beta = torch.sigmoid(rnd(1, t, hv))
    s0 = 0.1 * rnd(len(lens), hv, d, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return (q, k, v, g, beta), {"initial_state": s0, "cu_seqlens": cu}


def ratio(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def kernel_level(configs):
    rows = []
    for name, lens, hv, d in configs:
        args, kw = kernel_inputs(lens, hv, d, seed=0)
        want = torch_chunked.kda_chunked(*(a.double() for a in args), **{**kw, "initial_state": kw["initial_state"].double()})
        g = args[3]
        for key, (label, mm1, mm2) in {**VARIANTS, **KERNEL_ONLY}.items():
            t0 = time.time()
            out = make_variant(mm1, mm2)(*args, **kw)
            o, s = out.o, out.state
            row = {"config": name, "lens": lens, "HV": hv, "K": d, "V": d, "variant": key, "label": label,
                   "error_ratio_o": ratio(o, want.o), "error_ratio_final_state": ratio(s, want.state),
                   "seconds": round(time.time() - t0, 2)}
            rows.append(row)
            print(f"  kernel {name:>22} {key:>14}: o {row['error_ratio_o']:.2e}  state "
                  f"{row['error_ratio_final_state']:.2e}", flush=True)
        print(f"  ({name}: |g| quantiles 1/50/99% = "
              f"{[round(x, 4) for x in (-g).flatten().quantile(torch.tensor([.01, .5, .99])).tolist()]})")
    return rows


# ---------------------------------------------------------------- model level

def model_level(presets, dtypes, variants, draws, noise_draws, noise_eps):
    import k3.conformance.cases.model as model_cases
    from k3.conformance.registry import items
    from k3.conformance.runner import RunContext, run_item
    from k3.platform import select_platform

    cases = [i for i in items("full", ("model",)) if i.case.name == "model.greedy" and i.dtype in dtypes
             and any(f"{p}_" in i.sample.shape for p in presets)]
    current = {"fn": None}
    dispatch = lambda *a, **kw: current["fn"](*a, **kw)  # noqa: E731
    platform = select_platform("reference")
    platform.kernels = dataclasses.replace(platform.kernels,
                                           kda=dataclasses.replace(platform.kernels.kda, chunked=dispatch))
    ctx = RunContext(platform)

    seen = {}
    real_compare = model_cases.compare_tokens_to_oracle

    def spy(name, got, same_dtype, oracle, margin):
        seen["traces"] = (got, same_dtype, oracle, margin)
        return real_compare(name, got, same_dtype, oracle, margin)

    runs = []                      # (variant key, draw, label, kda_chunked)
    for key in variants:
        label, mm1, mm2 = VARIANTS[key]
        runs.append((key, 0, label, make_variant(mm1, mm2)))
        if key in DITHERED:
            runs += [(key, d, label + f", dithered draw {d}", make_variant(mm1, mm2, d)) for d in range(1, draws + 1)]
    runs += [(f"noise{eps:g}", d, f"exact + relative noise {eps:g} on o and state (control), draw {d}",
              make_noise(eps, d)) for eps in noise_eps for d in range(1, noise_draws + 1)]
    rows = []
    with mock.patch.object(model_cases, "compare_tokens_to_oracle", spy):
        for item in cases:
            for key, draw, label, fn in runs:
                current["fn"] = fn
                seen.clear()
                t0 = time.time()
                outcome = run_item(ctx, item)
                row = {"case": item.id, "dtype": item.dtype, "variant": key, "draw": draw, "label": label,
                       "passed": bool(outcome.passed), "summary": outcome.summary(),
                       "seconds": round(time.time() - t0, 1)}
                for out in outcome.outputs:
                    if out.name == "logits_vs_float64":
                        row["logits_error_ratio_vs_oracle"] = out.ratio
                        row["logits_error_allowed"] = out.tolerance.ratio
                if "traces" in seen:
                    got, same, oracle, margin = seen["traces"]
                    flips = []
                    for r, (gt, w, o) in enumerate(zip(got, same, oracle)):
                        truth = o.stacked()
                        top = truth.topk(2, dim=-1).values
                        gaps = (top[:, 0] - top[:, 1]).tolist()
                        for step, (logits, wtok) in enumerate(zip(gt.logits, w.tokens)):
                            mine, best = int(logits.argmax()), int(truth[step].argmax())
                            if mine not in (best, wtok):
                                flips.append({"request": r, "step": step, "oracle_gap": gaps[step],
                                              "token": mine, "oracle": best, "same_dtype_reference": wtok})
                    row["margin"] = margin
                    row["flips_vs_oracle"] = flips
                    row["max_flip_gap"] = max((f["oracle_gap"] for f in flips), default=0.0)
                rows.append(row)
                print(f"  model {item.id:>55} {key:>14} {draw:>2}: {'pass' if row['passed'] else 'FAIL'}  "
                      f"max flip gap {row.get('max_flip_gap', float('nan')):.3g}  "
                      f"logits err {row.get('logits_error_ratio_vs_oracle', float('nan')):.4g}  "
                      f"({row['seconds']} s)", flush=True)
    return rows


# ---------------------------------------------------------------- main

def summarise(model):
    """Per case and variant: the undithered run's pass / max flip gap / logits error ratio, and
    how many of the dithered draws (or noise draws) pass."""
    out = {}
    for r in model:
        cell = out.setdefault(r["case"], {}).setdefault(r["variant"], {"draws_passed": 0, "draws": 0})
        if not r["variant"].startswith("noise") and r["draw"] == 0:
            cell.update(passed=r["passed"], max_flip_gap=r.get("max_flip_gap"),
                        logits_error_ratio_vs_oracle=r.get("logits_error_ratio_vs_oracle"),
                        logits_error_allowed=r.get("logits_error_allowed"))
        else:
            cell["draws"] += 1
            cell["draws_passed"] += int(r["passed"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--presets", default="k3-tiny,k3.1-pro-tiny,kimi-linear-tiny")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--draws", type=int, default=8, help="dithered draws per TF32 / bf16 variant")
    ap.add_argument("--noise-draws", type=int, default=8)
    ap.add_argument("--noise-eps", default="1e-6,1e-5,1e-4,3e-4", help="relative noise sizes of the control")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="1: a second OpenMP thread on a busy 2-core CPU is ~10x slower")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    started = time.time()

    print("kernel level (error ratios against the float64 reference)")
    # cvt.rna self-check: ties away from zero, both signs
    t = torch.tensor([1.0 + 2 ** -11, -(1.0 + 2 ** -11), 1.0 + 2 ** -12, 1.0 + 3 * 2 ** -11])
    assert round_tf32(t).tolist() == [1.0 + 2 ** -10, -(1.0 + 2 ** -10), 1.0, 1.0 + 2 ** -9], round_tf32(t)
    configs = [("T2048_HV4_K128", [2048], 4, 128), ("ragged_700-1300-48_HV4_K128", [700, 1300, 48], 4, 128)]
    kernel = kernel_level(configs)

    model = []
    if not a.skip_model:
        print("model level (conformance model.greedy on the reference platform, kda.chunked replaced)")
        model = model_level(a.presets.split(","), a.dtypes.split(","), a.variants.split(","), a.draws,
                            a.noise_draws, [float(e) for e in a.noise_eps.split(",")])

    print("\nkernel-level error ratios vs float64 (final state / o)")
    names = [c[0] for c in configs]
    print(f"{'variant':>16} " + " ".join(f"{n:>32}" for n in names))
    for key in {**VARIANTS, **KERNEL_ONLY}:
        cells = []
        for n in names:
            r = next(r for r in kernel if r["config"] == n and r["variant"] == key)
            cells.append(f"{r['error_ratio_final_state']:.2e} / {r['error_ratio_o']:.2e}".rjust(32))
        print(f"{key:>16} " + " ".join(cells))
    summary = summarise(model)
    if model:
        print("\nmodel.greedy: undithered pass/FAIL (max oracle gap of a token off both the oracle's and the "
              "same-dtype reference's; logits error ratio vs oracle / allowed), dithered or noise draws passed")
        for cid, per in summary.items():
            print(f"  {cid.split('/')[1].split('_')[0]} {cid.split('/')[-1]}")
            for key, c in per.items():
                head = "" if "passed" not in c else (
                    f"{'pass' if c['passed'] else 'FAIL'} (gap {c['max_flip_gap']:.2f}; logits "
                    f"{c['logits_error_ratio_vs_oracle']:.3g} / {c['logits_error_allowed']:.3g})")
                draws = f"draws {c['draws_passed']}/{c['draws']} pass" if c["draws"] else ""
                print(f"    {key:>14}: {head:<50} {draws}")

    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": host.node(), "torch": torch.__version__, "threads": a.threads, "args": vars(a) | {"out": str(a.out)},
              "method": __doc__, "variants": {**{k: v[0] for k, v in {**VARIANTS, **KERNEL_ONLY}.items()},
                                              "noise<eps>": "exact + relative noise eps on o and state (control)"},
              "kernel": kernel, "model_summary": summary, "model": model,
              "duration_s": round(time.time() - started, 1)}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    print(f"total {result['duration_s']} s")


if __name__ == "__main__":
    main()
