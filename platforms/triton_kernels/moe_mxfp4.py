"""Routed experts over MXFP4 weights in Triton (W4A16, dequantised inside the kernel):
`MoEKernels.experts` (see k3.reference.experts_forward for the contract).

Two launches, grouped by expert so each weight tile is read once per BLOCK_M tokens routed to
that expert (not once per token):
  1. gate/up: program (expert e, token block, I block) gathers the rows of x routed to e,
     dequantises its slice of w13 (E2M1 codes x E8M0 scales) tile by tile, multiplies both
     halves (gate rows, up rows) and applies SiTU-GLU (or SiLU-GLU) in fp32, writing one fp32
     row of activations per (token, choice);
  2. down: program (expert e, token block, L block) multiplies those rows by e's w2 and scales
     them by the routing weight, one fp32 row per (token, choice);
then the k rows of each token are summed in torch (a fixed order: no atomics, so the result is
the same at every batch composition). Tokens are grouped by a device-side argsort of the
expert ids: no host synchronisation, so decode steps can be captured in a CUDA graph, and
`dense_dispatch` (the reference's host-sync-free mode) changes nothing here.

MXFP4 packs element 2j in the low nibble and 2j+1 in the high nibble of byte j; the kernel
never interleaves them: it multiplies the even columns of x by the low nibbles and the odd
columns by the high ones. bf16 and fp16 activations go through tf32 tensor-core products with
fp32 accumulation (exact for them and for the weights); fp32 activations use IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref
from k3.quant.mxfp4 import MXFP4Tensor

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _e2m1(code):
    """E2M1 nibble -> fp32: sign, 2-bit exponent, 1-bit mantissa (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile_t(packed_ptr, scales_ptr, e, rows, mask_r, j0, s_pe, s_pr, s_se, s_sr, BLOCK_J: tl.constexpr):
    """Dequantised low and high nibbles of bytes j0..j0+BLOCK_J of `rows`, transposed:
    ([BLOCK_J, R] even columns, [BLOCK_J, R] odd columns) in fp32."""
    j = j0 + tl.arange(0, BLOCK_J)
    byte = tl.load(packed_ptr + e * s_pe + rows[None, :] * s_pr + j[:, None], mask=mask_r[None, :], other=0)
    byte = byte.to(tl.int32)
    sc = tl.load(scales_ptr + e * s_se + rows[None, :] * s_sr + (j // 16)[:, None], mask=mask_r[None, :], other=127)
    sc = sc.to(tl.int32)
    mult = tl.where(sc == 255, float("nan"), tl.exp2((tl.minimum(sc, 254) - 127).to(tl.float32)))
    return _e2m1(byte & 15) * mult, _e2m1(byte >> 4) * mult


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32 operands: IEEE products for fp32 models; tf32 otherwise, which holds bf16 and fp16
    activations and every MXFP4 weight exactly (only the fp32 SiTU outputs round, by 2^-11)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _routed_choices(order_ptr, start_ptr, e, m0, count, BLOCK_M: tl.constexpr):
    """The (token, choice) indices m0..m0+BLOCK_M-1 routed to expert e (int64) and their mask."""
    slot = m0 + tl.arange(0, BLOCK_M)
    mask_m = slot < count
    choice = tl.load(order_ptr + tl.load(start_ptr + e) + slot, mask=mask_m, other=0).to(tl.int64)
    return choice, mask_m


@triton.jit
def _even_odd_columns(ptr, rows, s_row, c0, mask_m, HALF: tl.constexpr):
    """Columns c0, c0+2, ... and c0+1, c0+3, ... (HALF each) of `rows` as fp32, the halves that
    multiply the low and the high nibbles of the packed weights."""
    half = tl.arange(0, HALF)
    even = tl.load(ptr + rows[:, None] * s_row + (c0 + 2 * half)[None, :], mask=mask_m[:, None], other=0.0)
    odd = tl.load(ptr + rows[:, None] * s_row + (c0 + 2 * half + 1)[None, :], mask=mask_m[:, None], other=0.0)
    return even.to(tl.float32), odd.to(tl.float32)


@triton.jit
def _gate_up_kernel(
    x_ptr, p13_ptr, s13_ptr, order_ptr, start_ptr, count_ptr, act_ptr,
    s_x, s_pe, s_pr, s_se, s_sr, s_act,
    TOPK, beta, linear_beta,
    L: tl.constexpr, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)                # e * expert stride can pass 2^31 (k3-slice: 1.4e9)
    m0 = tl.program_id(1) * BLOCK_M
    count = tl.load(count_ptr + e)
    if m0 >= count:
        return
    choice, mask_m = _routed_choices(order_ptr, start_ptr, e, m0, count, BLOCK_M)
    token = choice // TOPK
    col = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = col < I
    acc_g = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        x_even, x_odd = _even_odd_columns(x_ptr, token, s_x, l0, mask_m, BLOCK_L // 2)
        g_lo, g_hi = _mxfp4_tile_t(p13_ptr, s13_ptr, e, col, mask_i, l0 // 2, s_pe, s_pr, s_se, s_sr, BLOCK_L // 2)
        acc_g += _dot(x_even, g_lo, IEEE) + _dot(x_odd, g_hi, IEEE)
        u_lo, u_hi = _mxfp4_tile_t(p13_ptr, s13_ptr, e, I + col, mask_i, l0 // 2, s_pe, s_pr, s_se, s_sr,
                                   BLOCK_L // 2)
        acc_u += _dot(x_even, u_lo, IEEE) + _dot(x_odd, u_hi, IEEE)
    if SITU:
        act = beta * (2.0 * tl.sigmoid(2.0 * acc_g / beta) - 1.0) * tl.sigmoid(acc_g)     # beta tanh(g/beta) sig(g)
        if HAS_LINEAR_BETA:
            acc_u = linear_beta * (2.0 * tl.sigmoid(2.0 * acc_u / linear_beta) - 1.0)
    else:
        act = acc_g * tl.sigmoid(acc_g)
    tl.store(act_ptr + choice[:, None] * s_act + col[None, :], act * acc_u, mask=mask_m[:, None] & mask_i[None, :])


@triton.jit
def _down_kernel(
    act_ptr, p2_ptr, s2_ptr, order_ptr, start_ptr, count_ptr, weight_ptr, y_ptr,
    s_act, s_pe, s_pr, s_se, s_sr, s_y,
    L: tl.constexpr, I: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)                # e * expert stride can pass 2^31 (k3-slice: 1.4e9)
    m0 = tl.program_id(1) * BLOCK_M
    count = tl.load(count_ptr + e)
    if m0 >= count:
        return
    choice, mask_m = _routed_choices(order_ptr, start_ptr, e, m0, count, BLOCK_M)
    row = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = row < L
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    for c0 in range(0, I, BLOCK_C):
        a_even, a_odd = _even_odd_columns(act_ptr, choice, s_act, c0, mask_m, BLOCK_C // 2)
        w_lo, w_hi = _mxfp4_tile_t(p2_ptr, s2_ptr, e, row, mask_o, c0 // 2, s_pe, s_pr, s_se, s_sr, BLOCK_C // 2)
        acc += _dot(a_even, w_lo, IEEE) + _dot(a_odd, w_hi, IEEE)
    w = tl.load(weight_ptr + choice, mask=mask_m, other=0.0)
    tl.store(y_ptr + choice[:, None] * s_y + row[None, :], acc * w[:, None], mask=mask_m[:, None] & mask_o[None, :])


def covers(x, w13, w2, activation) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    if not (isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor)) or x.dtype not in _ACTIVATIONS:
        return False
    e, two_i, l = w13.shape
    return (activation in ("situ", "silu") and l % 32 == 0 and (two_i // 2) % 32 == 0 and x.stride(-1) == 1
            and w13.packed.stride(-1) == 1 and w2.packed.stride(-1) == 1
            and w13.scales.stride(-1) == 1 and w2.scales.stride(-1) == 1)


# The model's dimensions are compile-time constants (also because the Triton interpreter
# cannot take a runtime loop bound): one compiled kernel per (L, I), as for any model.
def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                    dense_dispatch=False, block_m=16):
    """`k3.reference.experts_forward` over MXFP4 experts (same signature and contract).

    block_m: tokens per program (a launch option for benchmarks; >= 16 for the tensor cores).
    """
    if not covers(x, w13, w2, activation):
        return ref.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                   linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)
    if activation == "situ" and beta is None:
        raise ValueError("experts_forward: beta is required for activation='situ' (K3: 4.0)")
    t, l = x.shape
    if t == 0:
        return torch.zeros_like(x)
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    # group the T*k (token, choice) pairs by local expert; ids outside this rank go to bucket e_local
    local = (topk_ids.reshape(-1).long() - expert_start)
    local = torch.where((local >= 0) & (local < e_local), local, e_local)
    order = torch.argsort(local, stable=True).to(torch.int32)                          # [T*k]
    counts = torch.bincount(local, minlength=e_local + 1)[:e_local].to(torch.int32)    # [E_local]
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    act = torch.empty(t * topk, inter, dtype=torch.float32, device=x.device)
    y = torch.zeros(t * topk, l, dtype=torch.float32, device=x.device)                # rows of other ranks stay 0
    ieee = x.dtype == torch.float32
    m_blocks = triton.cdiv(t, block_m)                      # a token chooses an expert at most once
    block_l, block_i = 64 if l % 64 == 0 else 32, 32
    _gate_up_kernel[(e_local, m_blocks, triton.cdiv(inter, block_i))](
        x, w13.packed, w13.scales, order, starts, counts, act,
        x.stride(0), *w13.packed.stride()[:2], *w13.scales.stride()[:2], act.stride(0),
        topk, float(beta or 1.0), float(linear_beta or 1.0),
        L=l, I=inter, SITU=activation == "situ", HAS_LINEAR_BETA=linear_beta is not None, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_L=block_l,
    )
    weights = topk_weights.reshape(-1).to(torch.float32)
    block_o, block_c = 32, 64 if inter % 64 == 0 else 32
    _down_kernel[(e_local, m_blocks, triton.cdiv(l, block_o))](
        act, w2.packed, w2.scales, order, starts, counts, weights, y,
        act.stride(0), *w2.packed.stride()[:2], *w2.scales.stride()[:2], y.stride(0),
        L=l, I=inter, IEEE=ieee, BLOCK_M=block_m, BLOCK_O=block_o, BLOCK_C=block_c,
    )
    return y.view(t, topk, l).sum(1).to(x.dtype)
