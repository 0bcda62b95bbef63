"""The diagonal blocks of chunked KDA's intra-chunk products in Triton, computed where they are
written with nothing materialised: the part of `torch_kernels/kda_chunked_blocked.py`'s phase 1
that its torch einsums spend most of their time on (each block's [16, 16, K] pairwise decays,
hundreds of MB per group at K3's 96 heads x 128, built and read in memory-bound passes).

For each chunk s, head h and diagonal block of BLOCK rows starting at b0, and i >= j in it:

    A_kk[s, h, b0+i, b0+j] = sum_c k[s,h,b0+i,c] e^(G[s,h,b0+i,c] - G[s,h,b0+j,c]) k[s,h,b0+j,c]
    A_qk[s, h, b0+i, b0+j] = sum_c q[s,h,b0+i,c] e^(G[s,h,b0+i,c] - G[s,h,b0+j,c]) k[s,h,b0+j,c]

and 0 for j > i. G, the cumulative log decay, never increases along the chunk, so the exponent
is <= 0 where i >= j; j > i is masked to -inf before the exponential, so nothing overflows
whatever the gate.

One program per (chunk x head, block): it walks K in slices of BLOCK_K, forms the
[BLOCK, BLOCK, BLOCK_K] decays and products in registers and sums them over the slice into fp32
accumulators (elementwise fp32 only: no tensor-core dots, so no TF32 rounding). Inputs in bf16,
fp16 or fp32 are computed in fp32; float64 goes to the torch einsums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels.kda_chunked_blocked import diagonal_blocks_torch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _diagonal_kernel(
    q_ptr, k_ptr, g_ptr, akk_ptr, aqk_ptr, HV,
    sq_s, sq_h, sq_c, sq_k, sk_s, sk_h, sk_c, sk_k, sg_s, sg_h, sg_c, sg_k,
    sa_s, sa_h, sa_i, sa_j, sb_s, sb_h, sb_i, sb_j,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    sh = tl.program_id(0).to(tl.int64)
    s = sh // HV
    h = sh % HV
    rows = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)     # [BLOCK], the block's rows
    ii = tl.arange(0, BLOCK)
    lower = ii[:, None] >= ii[None, :]                                       # [i, j]
    q_base = q_ptr + s * sq_s + h * sq_h + rows[:, None] * sq_c
    k_base = k_ptr + s * sk_s + h * sk_h + rows[:, None] * sk_c
    g_base = g_ptr + s * sg_s + h * sg_h + rows[:, None] * sg_c
    acc_kk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    acc_qk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for c0 in range(0, K, BLOCK_K):
        cc = c0 + tl.arange(0, BLOCK_K)
        inside = (cc < K)[None, :]                                           # [1, BLOCK_K]
        # channels past K read 0: a zero k makes their products 0 whatever the decay
        qi = tl.load(q_base + cc[None, :] * sq_k, mask=inside, other=0.0).to(tl.float32)   # [BLOCK, BLOCK_K]
        ki = tl.load(k_base + cc[None, :] * sk_k, mask=inside, other=0.0).to(tl.float32)
        gi = tl.load(g_base + cc[None, :] * sg_k, mask=inside, other=0.0).to(tl.float32)
        diff = gi[:, None, :] - gi[None, :, :]                               # [i, j, BLOCK_K]
        decay = tl.exp(tl.where(lower[:, :, None], diff, float("-inf")))     # <= 1; 0 above the diagonal
        right = decay * ki[None, :, :]                                       # e^(G_i - G_j) k_j
        acc_kk += tl.sum(ki[:, None, :] * right, axis=2)                     # [i, j]
        acc_qk += tl.sum(qi[:, None, :] * right, axis=2)
    # the block's columns are its rows
    tl.store(akk_ptr + s * sa_s + h * sa_h + rows[:, None] * sa_i + rows[None, :] * sa_j,
             acc_kk.to(akk_ptr.dtype.element_ty))
    tl.store(aqk_ptr + s * sb_s + h * sb_h + rows[:, None] * sb_i + rows[None, :] * sb_j,
             acc_qk.to(aqk_ptr.dtype.element_ty))


def diagonal_blocks(q, k, G, A_kk, A_qk, block=16, block_k=32):
    """Write the diagonal blocks of A_kk and A_qk (the contract of
    `torch_kernels.kda_chunked_blocked.diagonal_blocks_torch`; the module docstring's formula).

    q, k, G: [S, HV, C, K], any strides (q already scaled; G the cumulative log decays, never
    increasing along C). A_kk, A_qk: [S, HV, C, C], any strides; only the C / block diagonal
    [block, block] blocks are written (0 above their diagonal), the rest is left as it was.
    C must be a multiple of block (a power of two, >= 16). block_k: key channels per slice
    (a power of two; a launch option for benchmarks). float64 goes to the torch einsums.
    """
    S, HV, C, K = q.shape
    if k.shape != q.shape or G.shape != q.shape or A_kk.shape != (S, HV, C, C) or A_qk.shape != (S, HV, C, C):
        raise ValueError(f"diagonal_blocks: q, k, G must be [S, HV, C, K] alike and A_kk, A_qk [S, HV, C, C] = "
                         f"[{S}, {HV}, {C}, {C}]; got q {tuple(q.shape)}, k {tuple(k.shape)}, G {tuple(G.shape)}, "
                         f"A_kk {tuple(A_kk.shape)}, A_qk {tuple(A_qk.shape)}")
    if block < 16 or block & (block - 1) or C % block:
        raise ValueError(f"diagonal_blocks: block must be a power of two >= 16 dividing C = {C}; got {block}")
    if any(x.dtype not in _DTYPES for x in (q, k, G, A_kk, A_qk)):
        return diagonal_blocks_torch(q, k, G, A_kk, A_qk, block=block)
    if S * HV == 0 or C == 0:
        return
    block_k = min(block_k, triton.next_power_of_2(K))
    _diagonal_kernel[(S * HV, C // block)](
        q, k, G, A_kk, A_qk, HV, *q.stride(), *k.stride(), *G.stride(), *A_kk.stride(), *A_qk.stride(),
        K=K, BLOCK=block, BLOCK_K=block_k,
    )
