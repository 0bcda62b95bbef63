"""The "gemv_mma" mode of the MXFP4 routed experts (moe_mxfp4.experts_forward): the gemv mode's
grid (one program per ((token, choice), block of BLOCK_N weight rows), no grouping by expert)
with the products on the tensor cores.

Why: the CUDA-core gemv (moe_mxfp4_gemv.py) spends about five instructions a weight (decode,
fp16-to-fp32 widening, one FMA each, activation handling) and stays near 45% of the weight-bytes
roofline however it is tiled (BENCHMARKS.md). Here each program decodes a 32-column E8M0 group
of its rows into fp16 registers (the same shift-and-mask pairs: an E2M1 code placed as an fp16's
sign, two lowest exponent bits and top mantissa bit is its value / 2^14, exact, subnormals
included) and hands them to `tl.dot` against the token's row as a block-diagonal operand (group g's 32
values in column g, `_rows_dot_token_mma`): the widening and the multiply-adds leave the
instruction stream.

Precision: the token's row is scaled by a power of two into fp16's range (`_token_operand_kernel`;
max |x| * 2^s in [2^14, 2^15)), which keeps every bf16 value exactly (fp16 has two more mantissa
bits) unless it is 2^29 times smaller than the row's largest, where fp16 turns subnormal. Products
are exact and accumulate in fp32 as the reference's do; the E8M0 scale multiplies each group's
fp32 partial sum and the power of two is taken back at the end, both exactly.

The columns inside a dot need not be in order, only the same for both operands: the decoded
codes come out as (word j, nibble pair c, half h) -> column 8j + c + 4h, so the token's row is
stored permuted the same way (`PAIR_ORDER`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_mxfp4_common import e8m0_multiplier, gated_activation
from .moe_mxfp4_gemv import _local_expert

MAX_GROUPS = 16
TOKENS = tl.constexpr(MAX_GROUPS)   # the dot's N (its smallest): column g holds the token's group g


@triton.jit
def _token_operand_kernel(src_ptr, out_ptr, factor_ptr, s_src, s_out, L: tl.constexpr, BLOCK: tl.constexpr,
                          K_STEP: tl.constexpr, CHUNK: tl.constexpr):
    """Row r of src ([R, L], any float dtype) as the block-diagonal fp16 operand of
    `_rows_dot_token_mma`: out[r, p, c] ([R, L, TOKENS]) is the row's value at pair-order position
    p (column 8j + c' + 4h at p = 8j + 2c' + h) times 2^s_r when p's group within its K_STEP
    columns is c, zero otherwise; factor[r] = 2^-s_r (fp32), s_r putting the row's largest
    magnitude in [2^14, 2^15) (0 for an all-zero row; at most 126)."""
    r = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    amax = tl.max(tl.abs(tl.load(src_ptr + r * s_src + col, mask=col < L, other=0.0).to(tl.float32)), axis=0)
    # floor(log2(amax)) from the fp32 exponent field (amax is a normal fp32 or zero here);
    # at most 2^126: a row below 2^-112 stays under 2^14, and 2^-shift stays a normal fp32
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.minimum(tl.where(amax > 0, 14 - exponent, 0), 126).to(tl.float32)
    tl.store(factor_ptr + r, tl.exp2(-shift))
    column = tl.arange(0, TOKENS)
    for p0 in tl.range(0, L, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        source = (p // 8) * 8 + (p % 8) // 2 + (p % 2) * 4
        value = (tl.load(src_ptr + r * s_src + source, mask=p < L, other=0.0).to(tl.float32)
                 * tl.exp2(shift)).to(tl.float16)                                # exact: a power of two
        tile = tl.where(((p % K_STEP) // 32)[:, None] == column[None, :], value[:, None],
                        tl.zeros_like(value)[:, None])                           # [CHUNK, TOKENS]
        tl.store(out_ptr + r * s_out + p[:, None] * TOKENS + column[None, :], tile, mask=(p < L)[:, None])


@triton.jit
def _rows_dot_token_mma(packed_ptr, scales_ptr, e, row0, N, src_ptr, L: tl.constexpr, s_pe, s_pr, s_se, s_sr,
                        BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr):
    """sum_k W_e[r, k] * src[k] / 2^14 for the BLOCK_N rows r = row0 + i (rows past N read as
    zero): [BLOCK_N] fp32. src: the token's row as `_token_operand_kernel` lays it out.

    A step takes GROUPS E8M0 groups (32 * GROUPS columns) in one `tl.dot`: the token's slice is a
    block-diagonal [32 * GROUPS, 16] operand (group g's 32 values in column g, zeros elsewhere;
    written once per row by `_token_operand_kernel` and loaded as it is), so column g of the
    product is group g's partial sum, which its scale multiplies; one dot, one shared-memory
    round trip and one barrier a step instead of one per group."""
    K_STEP: tl.constexpr = 32 * GROUPS
    rows = row0 + tl.arange(0, BLOCK_N)
    mask_r = rows < N
    words_ptr = (packed_ptr + e * s_pe + rows[:, None] * s_pr).to(tl.pointer_type(tl.uint32), bitcast=True)
    scale_ptr = scales_ptr + e * s_se + rows[:, None] * s_sr
    column = tl.arange(0, TOKENS)
    k_in_step = tl.arange(0, K_STEP)
    acc = tl.zeros((BLOCK_N, TOKENS), dtype=tl.float32)
    for k0 in tl.range(0, L, K_STEP, num_stages=STAGES):
        w = tl.load(words_ptr + k0 // 8 + tl.arange(0, 4 * GROUPS)[None, :], mask=mask_r[:, None], other=0)
        p04 = ((w << 9) & 0x0E000E00) | ((w << 12) & 0x80008000)          # fp16 pairs (c, c + 4)
        p15 = ((w << 5) & 0x0E000E00) | ((w << 8) & 0x80008000)
        p26 = ((w << 1) & 0x0E000E00) | ((w << 4) & 0x80008000)
        p37 = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
        # tl.join stacks on a new last axis: [N, words, 2 (i), 2 (o)] holds pair c = 2i + o
        pairs = tl.join(tl.join(p04, p26), tl.join(p15, p37))
        low = (pairs & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)    # column 8j + c
        high = (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True)      # column 8j + c + 4
        codes = tl.reshape(tl.join(low, high), (BLOCK_N, K_STEP))            # pair order
        token = tl.load(src_ptr + (k0 + k_in_step)[:, None] * TOKENS + column[None, :])  # [K_STEP, TOKENS]
        part = tl.dot(codes, token)                                          # [N, TOKENS]: a group a column
        sc = tl.load(scale_ptr + k0 // 32 + column[None, :], mask=mask_r[:, None] & (column[None, :] < GROUPS),
                     other=127).to(tl.int32)
        acc += part * e8m0_multiplier(sc)
    return tl.sum(acc, axis=1)


@triton.jit
def gate_up_mma_kernel(
    x_ptr, x_factor_ptr, p13_ptr, s13_ptr, ids_ptr, act_ptr,
    s_x, s_pe, s_pr, s_se, s_sr, s_act,
    TOPK, expert_start, E_LOCAL, beta, linear_beta,
    L: tl.constexpr, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, ACT_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr,
):
    n, e, local = _local_expert(ids_ptr, expert_start, E_LOCAL)
    if local:
        col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        token = n // TOPK
        x_row = x_ptr + token * s_x
        factor = tl.load(x_factor_ptr + token) * 16384.0                   # exact: powers of two
        row0 = tl.program_id(1) * BLOCK_N
        g = _rows_dot_token_mma(p13_ptr, s13_ptr, e, row0, I, x_row, L, s_pe, s_pr, s_se, s_sr, BLOCK_N,
                                GROUPS, STAGES) * factor
        u = _rows_dot_token_mma(p13_ptr, s13_ptr, e, I + row0, 2 * I, x_row, L, s_pe, s_pr, s_se, s_sr, BLOCK_N,
                                GROUPS, STAGES) * factor
        out = gated_activation(g, u, beta, linear_beta, SITU, HAS_LINEAR_BETA)
        if ACT_BF16:                                      # as the reference rounds them in a bf16 model
            out = out.to(tl.bfloat16).to(tl.float32)
        tl.store(act_ptr + n * s_act + col, out, mask=col < I)


@triton.jit
def down_mma_kernel(
    act_ptr, act_factor_ptr, p2_ptr, s2_ptr, ids_ptr, weight_ptr, y_ptr,
    s_act, s_pe, s_pr, s_se, s_sr, s_y,
    expert_start, E_LOCAL,
    L: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr,
):
    n, e, local = _local_expert(ids_ptr, expert_start, E_LOCAL)
    row = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = row < L
    if local:
        out = _rows_dot_token_mma(p2_ptr, s2_ptr, e, tl.program_id(1) * BLOCK_N, L, act_ptr + n * s_act, I,
                                  s_pe, s_pr, s_se, s_sr, BLOCK_N, GROUPS, STAGES)
        out *= tl.load(act_factor_ptr + n) * 16384.0 * tl.load(weight_ptr + n).to(tl.float32)
        tl.store(y_ptr + n * s_y + row, out, mask=mask_n)
    else:                                                 # another rank's expert: contributes nothing
        tl.store(y_ptr + n * s_y + row, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=mask_n)


def token_operand(v: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_token_operand_kernel` over v [R, L]: (the block-diagonal fp16 operands [R, L, TOKENS],
    factors [R] fp32)."""
    r, length = v.shape
    out = torch.empty(r, length, MAX_GROUPS, dtype=torch.float16, device=v.device)
    factor = torch.empty(r, dtype=torch.float32, device=v.device)
    _token_operand_kernel[(r,)](v, out, factor, v.stride(0), out.stride(0), L=length,
                                BLOCK=triton.next_power_of_2(length), K_STEP=block_k, CHUNK=256, num_warps=4)
    return out, factor


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta, linear_beta, expert_start,
                    block_n, block_k, num_warps, stages=None):
    """moe_mxfp4.experts_forward's gemv_mma mode: [T, L] of x.dtype (module docstring). Launches:
    the token rows to fp16, gate/up, the activation rows to fp16, down, the sum over choices.
    block_k: columns a step, 32 to 512 (a power of two dividing L and I)."""
    groups = block_k // 32
    if not 1 <= groups <= MAX_GROUPS or groups & (groups - 1):
        raise ValueError(f"gemv_mma: block_k {block_k} must be 32 to {32 * MAX_GROUPS}, a power of two")
    t, l = x.shape
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    stages = stages or 2
    x16, x_factor = token_operand(x, block_k)
    act = torch.empty(t * topk, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(t * topk, l, dtype=torch.float32, device=x.device)
    gate_up_mma_kernel[(t * topk, triton.cdiv(inter, block_n))](
        x16, x_factor, w13.packed, w13.scales, ids, act,
        x16.stride(0), *w13.packed.stride()[:2], *w13.scales.stride()[:2], act.stride(0),
        topk, expert_start, e_local, float(beta or 1.0), float(linear_beta or 1.0),
        L=l, I=inter, SITU=activation == "situ", HAS_LINEAR_BETA=linear_beta is not None,
        ACT_BF16=x.dtype == torch.bfloat16, BLOCK_N=block_n, GROUPS=groups, STAGES=stages,
        num_warps=num_warps,
    )
    act16, act_factor = token_operand(act, block_k)
    down_mma_kernel[(t * topk, triton.cdiv(l, block_n))](
        act16, act_factor, w2.packed, w2.scales, ids, weights, y,
        act16.stride(0), *w2.packed.stride()[:2], *w2.scales.stride()[:2], y.stride(0),
        expert_start, e_local, L=l, I=inter, BLOCK_N=block_n, GROUPS=groups, STAGES=stages,
        num_warps=num_warps,
    )
    return y.view(t, topk, l).sum(1).to(x.dtype)
