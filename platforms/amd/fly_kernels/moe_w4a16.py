"""MXFP4 routed experts with 16-bit (or fp32) activations, W4A16, in FlyDSL: `moe.experts` for
decode batches on AMD Instinct (gfx942 / gfx950). **Never executed** (no AMD GPU has been
reachable): lowered to AMDGCN in CI (tests/kernels/test_amd_flydsl.py), served only when
K3_AMD_FLYDSL=1 on a ROCm device (k3.platforms.amd.kernels), marked unverified in docs/amd.md.

One kernel, launched twice per call (gate/up, then down): a grouped gemv over (token, expert)
pairs, y[p, o] = sum_k x[token(p), k] * W[expert(p), o, k], W in MXFP4 (k3.quant.mxfp4: codes
uint8 [E, N, K/2], element 2j in the low nibble; E8M0 scales uint8 [E, N, K/32]). Program
(pair p, block of 4 x ROWS rows): each of its 4 wavefronts takes ROWS rows; lane l of a wave
reads bytes l, l + 64, ... of the row, decodes both nibbles in registers (E2M1 times
2^(scale - 127), exact in fp32), multiplies by the two activations in fp32 and the wave sums its
lanes by xor shuffles; lane 0 writes the fp32 result. A pair whose expert is not local
(expert < 0) writes zeros. Between the launches the wrapper applies the GLU activation in torch
(k3.reference.glu_activation, fp32, as the reference) and after the second combines the pairs
with their router weights (fp32), cast to x's dtype once.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
import torch
from flydsl.expr import range_constexpr

WAVE = 64                  # lanes of a CDNA wavefront (gfx942, gfx950)
WAVES = 4                  # wavefronts per workgroup
ROWS = 4                   # rows per wavefront
MAX_PAIRS = 64             # (token, expert) pairs above which the wrapper hands over (prefill)
TWO_POW_M127 = 5.877471754111438e-39


def _e2m1(code):
    """fp32 value of a 4-bit E2M1 code (int32 0..15): magnitude 0, .5, 1, 1.5, 2, 3, 4, 6."""
    m = code & 7
    e = m >> 1
    frac = fx.Float32(m & 1) * 0.5
    power = fx.Float32(fx.Int32(1) << fx.max(e - 1, 0))
    magnitude = (e == 0).select(frac, (frac + 1.0) * power)
    return ((code & 8) != 0).select(-magnitude, magnitude)


def _e8m0(byte):
    """2^(byte - 127) as fp32 for a scale byte (int32 0..255): 255 is NaN, 0 is 2^-127."""
    normal = (byte << 23).bitcast(fx.Float32)
    return (byte == 255).select(float("nan"), (byte == 0).select(TWO_POW_M127, normal))


@flyc.kernel
def mxfp4_gemv_kernel(X: fx.Tensor, Codes: fx.Tensor, Scales: fx.Tensor, PairToken: fx.Tensor,
                      PairExpert: fx.Tensor, Y: fx.Tensor, N: fx.Int32, K: fx.Constexpr[int]):
    """Y [P, N] fp32 = per pair p: X[PairToken[p], :K] @ W[PairExpert[p]]^T, W MXFP4 [E, N, K].
    Every tensor is passed flat (1-D, contiguous): a Fly memref of rank > 1 would read a scalar
    index as a column-major coordinate."""
    p = fx.block_idx.x
    lane = fx.thread_idx.x % WAVE
    wave = fx.thread_idx.x // WAVE
    token = fx.memref_load(PairToken, p)
    expert = fx.memref_load(PairExpert, p)
    local = expert >= 0
    expert = local.select(expert, 0)
    for r in range_constexpr(ROWS):
        row = (fx.block_idx.y * WAVES + wave) * ROWS + r
        live = row < N
        w_row = expert * N + live.select(row, 0)                     # row of the [E * N, ...] weights
        acc = fx.Float32(0.0)
        for step in range_constexpr(K // 2 // WAVE):
            j = step * WAVE + lane                                   # byte j: elements 2j, 2j + 1
            byte = fx.Int32(fx.memref_load(Codes, w_row * (K // 2) + j)) & 255
            scale = _e8m0(fx.Int32(fx.memref_load(Scales, w_row * (K // 32) + j // 16)) & 255)
            x_even = fx.memref_load(X, token * K + 2 * j).to(fx.Float32)
            x_odd = fx.memref_load(X, token * K + 2 * j + 1).to(fx.Float32)
            acc = acc + _e2m1(byte & 15) * scale * x_even + _e2m1(byte >> 4) * scale * x_odd
        for s in range_constexpr(6):                                 # log2(64) xor-shuffle rounds
            acc = acc + acc.shuffle_xor(WAVE >> (s + 1), WAVE)
        if live:
            if lane == 0:
                fx.memref_store(local.select(acc, 0.0), Y, p * N + row)


@flyc.jit
def mxfp4_gemv(X: fx.Tensor, Codes: fx.Tensor, Scales: fx.Tensor, PairToken: fx.Tensor, PairExpert: fx.Tensor,
               Y: fx.Tensor, P: fx.Int32, N: fx.Int32, K: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
    """Launch `mxfp4_gemv_kernel` over P pairs x ceil(N / (WAVES * ROWS)) row blocks."""
    per_block = WAVES * ROWS
    mxfp4_gemv_kernel(X, Codes, Scales, PairToken, PairExpert, Y, N, K).launch(
        grid=(P, (N + per_block - 1) // per_block, 1), block=(WAVES * WAVE, 1, 1), stream=stream)


def covers(x, w13, w2, topk_ids) -> bool:
    """Inputs this kernel computes: a ROCm device, MXFP4 experts whose widths are multiples of
    128 (one byte per lane per step), decode batches (at most MAX_PAIRS pairs)."""
    from k3.quant.mxfp4 import MXFP4Tensor

    if not (isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor) and x.is_cuda):
        return False
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[1] % (2 * WAVE) == 0
            and w2.shape[2] % (2 * WAVE) == 0 and topk_ids.numel() <= MAX_PAIRS)


def _gemv(x, w, token, expert) -> torch.Tensor:
    """[P, N] fp32: pair p's activations x[token[p]] times expert expert[p] of MXFP4 w [E, N, K]."""
    n, k = w.shape[1], w.shape[2]
    y = torch.empty(token.shape[0], n, dtype=torch.float32, device=x.device)
    mxfp4_gemv(x.reshape(-1), w.packed.reshape(-1), w.scales.reshape(-1), token, expert, y.view(-1), token.shape[0], n, k)
    return y


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                    dense_dispatch=False, fallback=None):
    """`k3.reference.experts_forward` (same signature and contract) for decode batches;
    anything `covers` refuses goes to `fallback` (the amd plugin's Triton entry)."""
    from k3.reference import glu_activation

    if not covers(x, w13, w2, topk_ids):
        return fallback(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                        linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)
    t, k = topk_ids.shape
    expert = topk_ids.reshape(-1).to(torch.int32) - expert_start
    expert = torch.where((expert >= 0) & (expert < w13.shape[0]), expert, -1)      # other ranks' experts
    token = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)
    h = glu_activation(_gemv(x, w13, token, expert), activation=activation, beta=beta, linear_beta=linear_beta)
    down = _gemv(h, w2, torch.arange(t * k, device=x.device, dtype=torch.int32), expert)   # [T * k, L]
    return (down.view(t, k, -1) * topk_weights.float()[..., None]).sum(1).to(x.dtype)


def example_args(tokens: int = 2, top_k: int = 2, experts: int = 4, n: int = 256, k: int = 512) -> tuple:
    """Arguments of `mxfp4_gemv` at a small K3-like shape, flat CPU placeholders (for lowering)."""
    pairs = tokens * top_k
    return (torch.empty(tokens * k, dtype=torch.bfloat16), torch.empty(experts * n * k // 2, dtype=torch.uint8),
            torch.empty(experts * n * k // 32, dtype=torch.uint8), torch.empty(pairs, dtype=torch.int32),
            torch.empty(pairs, dtype=torch.int32), torch.empty(pairs * n, dtype=torch.float32), pairs, n, k)
