"""Phase 1 of the batched chunked KDA prefill (`torch_kernels/kda_chunked_blocked.py`), every
chunk's intra-chunk work, in one Triton launch: `intra_chunk_torch`'s contract, which computes it
in torch as groups of batched matmuls, 16-row blocks and a triangular solve (about 35 of the
40 ms an 8K-token prompt took per K3 layer on an H200 with the Triton diagonal and recurrence).

One program per (chunk, head) gathers the chunk's rows through `index` (a padded chunk reads the
zero row: k = v = 0, no decay, beta = 0) and, with G the cumulative log decay along the chunk
(it never increases) and 16-row blocks b:

1. G per block (the running sum of the blocks before plus the block's own cumulative sum),
   kept in a scratch [C, K] for the rest of the program; q e^G, e^(G_C) and k e^(G_C - G).
2. For each row block i in order, for each column block j < i: the decay-weighted products
   k_i e^(G_i - G_j) k_j and q_i e^(G_i - G_j) k_j as one matmul of both sides scaled to the
   end r of block j, e^(G_i - G_r) and e^(G_r - G_j), each at most 1 (nothing can overflow
   whatever the gate); the diagonal block with its exact pairwise decays, elementwise in fp32.
   A_qk's block row is written (zeros above the diagonal), and L = beta A_kk's to a scratch.
   The solve of the WY/UT form, (I + L) [W | U] = beta [e^G k | v] with L strictly lower, is
   block forward substitution: X_i = D_i^-1 (R_i - sum_j L_ij X_j), the X_j of earlier blocks
   read back from W and U (written by this program, a CTA barrier apart) and D_i^-1, the
   inverse of the unit lower triangular diagonal block, as (I - L)(I + L^2)(I + L^4)(I + L^8)
   (six 16 x 16 dots) and one Newton step (without it the powers' rounding cost W three
   digits when the keys are strongly correlated); the row-by-row inverse is a launch option
   (7.3 against 5.8 ms at 8K tokens on the H200: its 30 cross-warp reductions a block).

Measured on the H200 (bench/kda_prefill.py, 8K tokens, 96 heads): 5.8 ms; a split into three
launches (decays; A's block rows, one program each; the solve) took 6.2 ms and was dropped.

Products: `tl.dot` with `input_precision` PRECISION, every dot SLICE (16 or 32) deep over K
(Triton's fp32 FMA dots hold their whole depth per thread): "ieee" is fp32 FMAs (exact fp32,
served); "tf32x3" three TF32 tensor-core products, as accurate as fp32 for this chain in
bench/kda_tf32_sensitivity.py, a launch option (6.9 ms: these dots are too small for tensor
cores to pay).

The "mma" form (`_intra_chunk_mma_kernel`, `intra_chunk(form="mma")`; 8.8 ms on an H100),
the same outputs from whole-chunk tensor-core dots (3xTF32 by default), one program per (chunk,
head) as well: step 1 as above; A_qk and L below the diagonal blocks a 16-column block j at a
time, every row at once: [C, MMA_SLICE] x [MMA_SLICE, 16] dots over K (wgmma's 64 rows), both
sides scaled to block j's end as above; the diagonal blocks exact as above, their inverses
D_i^-1 (as above) written into the scratch as T's diagonal blocks; T = (I + L)^-1's block rows
below by block forward substitution, T_i,<i = -D_i^-1 (L_i,<i T_<i,<i), a [16, C] x [C, C] and a
[16, 16] x [16, C] dot each (T overwrites L in the scratch a block row at a time); then
W = T (beta e^G k) and U = T (beta v) as [C, C] x [C, MMA_SLICE] dots. sm_90a (ptxas, K3's
C = 64, K = V = 128, 4 warps): 224 registers and no spills at MMA_SLICE = 64, 178 at 32.

The "split" form (`kda_intra_split.intra_chunk_split`, `intra_chunk(form="split")`; 9.0 ms on
an H100 against 5.9 for blocks): the same outputs from three kernels with wide grids and short chains (a program per
16-row block of A with its decays and diagonal inverse; T's block substitution per (chunk, head);
W and U a column slice per program), 3xTF32 for the wide dots by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels.kda_chunked_blocked import intra_chunk_torch

BLOCK = 16                    # rows of a block (the solve's diagonal blocks, the exact decays)
SLICE = 16                    # the depth of the K-deep dots (K walked in slices of it)
DIAG_SLICE = 16               # key channels per slice of the diagonal blocks' [16, 16, slice] decays
NEUMANN = True                # the diagonal blocks' inverse as a product of powers (six dots)
NUM_WARPS = 4                 # 168 registers, 24 B spilled at K3's C = 64, K = V = 128 (bench/ptxas_report.py):
                              # 5.8 ms at 8K tokens on the H200; 8 warps (one program an SM) took 10.1 ms
DIAG_COLUMNS = True           # the diagonal blocks a column at a time (`_diagonal_block_by_columns`): 5.24 against
                              # 5.75 ms with [16, 16, slice] decay tensors (`_diagonal_block`, served until 2026-12-07)
                              # on an H100 at 8K x 96 heads (bench/kda_prefill_ncu.py); kda.chunked + model cases
                              # 49 of 49 on the GPU with it
FORM = "blocks"               # the served kernel ("mma" and "split" are slower: the module docstring)
PRECISION = {"blocks": "ieee", "mma": "tf32x3", "split": "tf32x3"}   # each form's dots by default
                              # (split: its wide dots; its solve's are kda_intra_split.SOLVE_PRECISION)
MMA_SLICE = 64                # the mma form's tile width over K and V ([C, 64] tiles)
MMA_NUM_WARPS = 4


@triton.jit
def _offdiagonal_block(G_ptr, q_ptr, k_ptr, chunk_k, rows_i, rows_j, i, j, h, HV, K: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr, PRECISION: tl.constexpr):
    """(A_kk, A_qk) [BLOCK, BLOCK] of row block i and column block j < i: both sides scaled to
    the end r of block j, e^(G_i - G_r) <= 1 and e^(G_r - G_j) <= 1, SLICE-deep dots over K."""
    ii = tl.arange(0, BLOCK)
    ss = tl.arange(0, SLICE)
    akk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    aqk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for c0 in range(0, BLOCK_K, SLICE):
        cs = c0 + ss
        c_in = (cs < K)[None, :]
        Gi = tl.load(G_ptr + chunk_k + (i + ii)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        Gj = tl.load(G_ptr + chunk_k + (j + ii)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        Gr = tl.load(G_ptr + chunk_k + (j + BLOCK - 1) * K + cs, mask=cs < K, other=0.0)   # [SLICE]
        ki = tl.load(k_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        qi = tl.load(q_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        kj = tl.load(k_ptr + (rows_j * HV + h)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        left = tl.exp(Gi - Gr[None, :])                                 # [BLOCK, SLICE], <= 1
        right = tl.trans(kj * tl.exp(Gr[None, :] - Gj))                 # [SLICE, BLOCK], <= |k|
        akk = tl.dot(ki * left, right, acc=akk, input_precision=PRECISION)
        aqk = tl.dot(qi * left, right, acc=aqk, input_precision=PRECISION)
    return akk, aqk


@triton.jit
def _diagonal_block(G_ptr, q_ptr, k_ptr, chunk_k, rows_i, i, h, HV, K: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_K: tl.constexpr, DIAG_SLICE: tl.constexpr):
    """(A_kk, A_qk) [BLOCK, BLOCK] of diagonal block i: the exact pairwise decays e^(G_a - G_b),
    a >= b, masked to -inf above the diagonal before the exponential; elementwise fp32."""
    ii = tl.arange(0, BLOCK)
    ds = tl.arange(0, DIAG_SLICE)
    lower = ii[:, None] >= ii[None, :]
    akk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    aqk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for c0 in range(0, BLOCK_K, DIAG_SLICE):
        cs = c0 + ds
        c_in = (cs < K)[None, :]
        Gi = tl.load(G_ptr + chunk_k + (i + ii)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        ki = tl.load(k_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        qi = tl.load(q_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in, other=0.0)
        decay = tl.exp(tl.where(lower[:, :, None], Gi[:, None, :] - Gi[None, :, :], float("-inf")))
        right = decay * ki[None, :, :]                                  # [a, b, slice]: e^(G_a - G_b) k_b
        akk += tl.sum(ki[:, None, :] * right, axis=2)
        aqk += tl.sum(qi[:, None, :] * right, axis=2)
    return akk, aqk


@triton.jit
def _diagonal_block_by_columns(G_ptr, q_ptr, k_ptr, index_ptr, s, chunk_k, rows_i, i, h, HV, C: tl.constexpr,
                               K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                               DIAG_SLICE: tl.constexpr):
    """`_diagonal_block`'s (A_kk, A_qk), a column b at a time: [BLOCK, DIAG_SLICE] tiles of the
    decays e^(G_a - G_b) against row b's G and k (loaded as vectors), summed over the slice into
    column b; no [BLOCK, BLOCK, slice] tensor (whose broadcasts go through shared memory)."""
    ii = tl.arange(0, BLOCK)
    ds = tl.arange(0, DIAG_SLICE)
    akk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    aqk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for c0 in range(0, BLOCK_K, DIAG_SLICE):
        cs = c0 + ds
        c_in = cs < K
        Gi = tl.load(G_ptr + chunk_k + (i + ii)[:, None] * K + cs[None, :], mask=c_in[None, :], other=0.0)
        ki = tl.load(k_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in[None, :], other=0.0)
        qi = tl.load(q_ptr + (rows_i * HV + h)[:, None] * K + cs[None, :], mask=c_in[None, :], other=0.0)
        for b in range(BLOCK):
            row_b = tl.load(index_ptr + s * C + i + b).to(tl.int64)
            Gb = tl.load(G_ptr + chunk_k + (i + b) * K + cs, mask=c_in, other=0.0)            # [DIAG_SLICE]
            kb = tl.load(k_ptr + (row_b * HV + h) * K + cs, mask=c_in, other=0.0)
            right = tl.exp(tl.where(ii[:, None] >= b, Gi - Gb[None, :], float("-inf"))) * kb[None, :]
            column = ii[None, :] == b
            akk += tl.where(column, tl.sum(ki * right, 1)[:, None], 0.0)
            aqk += tl.where(column, tl.sum(qi * right, 1)[:, None], 0.0)
    return akk, aqk


@triton.jit
def _unit_lower_inverse(L, BLOCK: tl.constexpr, NEUMANN: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^-1 for L [BLOCK, BLOCK] strictly lower triangular (nilpotent: L^BLOCK = 0)."""
    ii = tl.arange(0, BLOCK)
    eye = (ii[:, None] == ii[None, :]).to(tl.float32)
    if NEUMANN:         # (I - L)(I + L^2)(I + L^4)(I + L^8) = sum_k (-L)^k for BLOCK = 16: six small dots
        Dinv = eye - L
        Lp = L
        for _ in tl.static_range(3):
            Lp = tl.dot(Lp, Lp, input_precision=PRECISION)
            Dinv = tl.dot(Dinv, Lp, acc=Dinv, input_precision=PRECISION)
        # one Newton step, X <- X + X (I - (I + L) X), takes back the accuracy the powers lose
        # to cancellation when the keys are strongly correlated (rounding of L^8)
        residual = eye - Dinv - tl.dot(L, Dinv, input_precision=PRECISION)
        Dinv = tl.dot(Dinv, residual, acc=Dinv, input_precision=PRECISION)
    else:               # forward substitution, row by row: row r = e_r - sum_b L[r, b] row b
        Dinv = eye
        for r in range(1, BLOCK):
            L_r = tl.sum(tl.where(ii[:, None] == r, L, 0.0), 0)         # [BLOCK] row r of L
            Dinv = tl.where(ii[:, None] == r, Dinv - tl.sum(L_r[:, None] * Dinv, 0)[None, :], Dinv)
    return Dinv


@triton.jit
def _decays(q_ptr, k_ptr, g_ptr, index_ptr, G_ptr, qeg_ptr, kdec_ptr, egc_ptr, s, h, sh, HV,
            C: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step 1 for chunk s, head h: G block by block (the running sum of the blocks before plus
    the block's own cumulative sum) into the scratch, q e^G, e^(G_C) and k e^(G_C - G)."""
    ii = tl.arange(0, BLOCK)
    kk = tl.arange(0, BLOCK_K)
    k_in = kk < K
    chunk_k = sh * C * K
    base = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for b in tl.static_range(0, C, BLOCK):
        rows = tl.load(index_ptr + s * C + b + ii).to(tl.int64)        # [BLOCK] packed rows
        src = (rows * HV + h)[:, None] * K + kk[None, :]
        g = tl.load(g_ptr + src, mask=k_in[None, :], other=0.0)         # [BLOCK, BLOCK_K]
        Gb = base[None, :] + tl.cumsum(g, 0)
        dst = chunk_k + (b + ii)[:, None] * K + kk[None, :]
        tl.store(G_ptr + dst, Gb, mask=k_in[None, :])
        q = tl.load(q_ptr + src, mask=k_in[None, :], other=0.0)
        tl.store(qeg_ptr + dst, q * tl.exp(Gb), mask=k_in[None, :])
        base += tl.sum(g, 0)
    tl.store(egc_ptr + sh * K + kk, tl.exp(base), mask=k_in)
    tl.debug_barrier()                                                  # G complete before it is read
    GC = tl.load(G_ptr + chunk_k + (C - 1) * K + kk, mask=k_in, other=0.0)
    for b in tl.static_range(0, C, BLOCK):
        rows = tl.load(index_ptr + s * C + b + ii).to(tl.int64)
        dst = chunk_k + (b + ii)[:, None] * K + kk[None, :]
        Gb = tl.load(G_ptr + dst, mask=k_in[None, :], other=0.0)
        kb = tl.load(k_ptr + (rows * HV + h)[:, None] * K + kk[None, :], mask=k_in[None, :], other=0.0)
        tl.store(kdec_ptr + dst, tl.exp(GC[None, :] - Gb) * kb, mask=k_in[None, :])


@triton.jit
def _solve_block_row(L_ij_ptr, L_ii, k_ptr, v_ptr, b_ptr, G_ptr, w_ptr, u_ptr, rows_i, i, h, HV, chunk_k, chunk_v,
                     K: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr, NEUMANN: tl.constexpr, PRECISION: tl.constexpr, C: tl.constexpr):
    """Block row i of the WY/UT solve, (I + L) [W | U] = beta [e^G k | v]:
    X_i = D_i^-1 (R_i - sum_{j < i} L_ij X_j), the X_j read back from W and U (written before
    a CTA barrier), L_ij from the [C, C] at L_ij_ptr (row-major), L_ii given."""
    ii = tl.arange(0, BLOCK)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.arange(0, BLOCK_V)
    k_in, v_in = kk < K, vv < V
    beta = tl.load(b_ptr + rows_i * HV + h)                             # [BLOCK]
    acc_w = tl.zeros((BLOCK, BLOCK_K), dtype=tl.float32)                # sum_j L_ij X_j
    acc_u = tl.zeros((BLOCK, BLOCK_V), dtype=tl.float32)
    for j in range(0, i, BLOCK):
        L = tl.load(L_ij_ptr + (i + ii)[:, None] * C + (j + ii)[None, :])
        Xw = tl.load(w_ptr + chunk_k + (j + ii)[:, None] * K + kk[None, :], mask=k_in[None, :], other=0.0)
        Xu = tl.load(u_ptr + chunk_v + (j + ii)[:, None] * V + vv[None, :], mask=v_in[None, :], other=0.0)
        acc_w = tl.dot(L, Xw, acc=acc_w, input_precision=PRECISION)
        acc_u = tl.dot(L, Xu, acc=acc_u, input_precision=PRECISION)
    Dinv = _unit_lower_inverse(L_ii, BLOCK, NEUMANN, PRECISION)
    Gi = tl.load(G_ptr + chunk_k + (i + ii)[:, None] * K + kk[None, :], mask=k_in[None, :], other=0.0)
    ki = tl.load(k_ptr + (rows_i * HV + h)[:, None] * K + kk[None, :], mask=k_in[None, :], other=0.0)
    vi = tl.load(v_ptr + (rows_i * HV + h)[:, None] * V + vv[None, :], mask=v_in[None, :], other=0.0)
    Rw = beta[:, None] * tl.exp(Gi) * ki - acc_w                        # [BLOCK, BLOCK_K]
    Ru = beta[:, None] * vi - acc_u                                     # [BLOCK, BLOCK_V]
    tl.store(w_ptr + chunk_k + (i + ii)[:, None] * K + kk[None, :], tl.dot(Dinv, Rw, input_precision=PRECISION),
             mask=k_in[None, :])
    tl.store(u_ptr + chunk_v + (i + ii)[:, None] * V + vv[None, :], tl.dot(Dinv, Ru, input_precision=PRECISION),
             mask=v_in[None, :])
    tl.debug_barrier()                                                  # X_i written before block i + 1 reads it


@triton.jit
def _intra_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, index_ptr,
    G_ptr, L_ptr, w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK: tl.constexpr, SLICE: tl.constexpr, DIAG_SLICE: tl.constexpr, PRECISION: tl.constexpr,
    NEUMANN: tl.constexpr, DIAG_COLUMNS: tl.constexpr = False,
):
    # One program per (chunk s, head h), all of phase 1. Packed rows, contiguous: q, k, g
    # [rows, HV, K]; v [rows, HV, V]; beta [rows, HV]; index [nseg, C] (the packed row of each
    # chunk position). Outputs and scratch, contiguous: G, W, qeG, kdec [nseg, HV, C, K]; U
    # [nseg, HV, C, V]; A_qk and L (beta A_kk, strictly lower) [nseg, HV, C, C]; eGC [nseg, HV, K]
    sh = tl.program_id(0).to(tl.int64)
    s = sh // HV
    h = sh % HV
    ii = tl.arange(0, BLOCK)
    chunk_k = sh * C * K                                                # (s, h)'s [C, K] tiles
    chunk_v = sh * C * V
    _decays(q_ptr, k_ptr, g_ptr, index_ptr, G_ptr, qeg_ptr, kdec_ptr, egc_ptr, s, h, sh, HV, C, K, BLOCK, BLOCK_K)
    tl.debug_barrier()
    strictly_lower = ii[:, None] > ii[None, :]
    for i in range(0, C, BLOCK):                                        # block rows in order
        rows_i = tl.load(index_ptr + s * C + i + ii).to(tl.int64)
        beta = tl.load(b_ptr + rows_i * HV + h)
        for j in range(0, i, BLOCK):                                    # left of the diagonal
            rows_j = tl.load(index_ptr + s * C + j + ii).to(tl.int64)
            akk, aqk = _offdiagonal_block(G_ptr, q_ptr, k_ptr, chunk_k, rows_i, rows_j, i, j, h, HV, K, BLOCK,
                                          BLOCK_K, SLICE, PRECISION)
            tl.store(a_ptr + sh * C * C + (i + ii)[:, None] * C + (j + ii)[None, :], aqk)
            tl.store(L_ptr + sh * C * C + (i + ii)[:, None] * C + (j + ii)[None, :], beta[:, None] * akk)
        if DIAG_COLUMNS:
            akk, aqk = _diagonal_block_by_columns(G_ptr, q_ptr, k_ptr, index_ptr, s, chunk_k, rows_i, i, h, HV, C, K,
                                                  BLOCK, BLOCK_K, DIAG_SLICE)
        else:
            akk, aqk = _diagonal_block(G_ptr, q_ptr, k_ptr, chunk_k, rows_i, i, h, HV, K, BLOCK, BLOCK_K, DIAG_SLICE)
        tl.store(a_ptr + sh * C * C + (i + ii)[:, None] * C + (i + ii)[None, :], aqk)
        for j in range(i + BLOCK, C, BLOCK):                            # zeros right of the diagonal
            tl.store(a_ptr + sh * C * C + (i + ii)[:, None] * C + (j + ii)[None, :],
                     tl.zeros((BLOCK, BLOCK), dtype=tl.float32))
        tl.debug_barrier()                                              # L's row written before it is read
        _solve_block_row(L_ptr + sh * C * C, tl.where(strictly_lower, beta[:, None] * akk, 0.0), k_ptr, v_ptr,
                         b_ptr, G_ptr, w_ptr, u_ptr, rows_i, i, h, HV, chunk_k, chunk_v, K, V, BLOCK, BLOCK_K,
                         BLOCK_V, NEUMANN, PRECISION, C)


@triton.jit
def _below_diagonal_columns(G_ptr, q_ptr, k_ptr, b_ptr, index_ptr, a_ptr, L_ptr, s, h, sh, HV, j,
                            C: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK: tl.constexpr, SLICE: tl.constexpr, PRECISION: tl.constexpr):
    """Column block j (its first column; not the last block) of A_qk and of L = beta A_kk, every
    row of the chunk at once: [BLOCK_C, SLICE] x [SLICE, BLOCK] tensor-core dots over K, the rows
    below the block scaled to its end r, e^(G_i - G_r) <= 1, the block's own rows from r,
    e^(G_r - G_j) <= 1 (nothing overflows whatever the gate). Rows above the block get zeros,
    the diagonal block's rows nothing."""
    cc = tl.arange(0, BLOCK_C)
    ii = tl.arange(0, BLOCK)
    ss = tl.arange(0, SLICE)
    r = j + BLOCK - 1
    below = (cc > r) & (cc < C)
    rows = tl.load(index_ptr + s * C + cc, mask=below, other=0).to(tl.int64)          # [BLOCK_C]
    rows_j = tl.load(index_ptr + s * C + j + ii).to(tl.int64)                         # [BLOCK]
    chunk_k = sh * C * K
    akk = tl.zeros((BLOCK_C, BLOCK), dtype=tl.float32)
    aqk = tl.zeros((BLOCK_C, BLOCK), dtype=tl.float32)
    for c0 in tl.static_range(0, BLOCK_K, SLICE):
        cs = c0 + ss
        c_in = cs < K
        m = below[:, None] & c_in[None, :]
        G = tl.load(G_ptr + chunk_k + cc[:, None] * K + cs[None, :], mask=m, other=0.0)       # [BLOCK_C, SLICE]
        Gr = tl.load(G_ptr + chunk_k + r * K + cs, mask=c_in, other=0.0)                      # [SLICE]
        Gj = tl.load(G_ptr + chunk_k + (j + ii)[:, None] * K + cs[None, :], mask=c_in[None, :], other=0.0)
        left = tl.exp(tl.where(m, G - Gr[None, :], float("-inf")))                          # <= 1, 0 off `below`
        ki = tl.load(k_ptr + (rows * HV + h)[:, None] * K + cs[None, :], mask=m, other=0.0)
        qi = tl.load(q_ptr + (rows * HV + h)[:, None] * K + cs[None, :], mask=m, other=0.0)
        kj = tl.load(k_ptr + (rows_j * HV + h)[:, None] * K + cs[None, :], mask=c_in[None, :], other=0.0)
        right = tl.trans(kj * tl.exp(Gr[None, :] - Gj))                                     # [SLICE, BLOCK]
        akk = tl.dot(ki * left, right, acc=akk, input_precision=PRECISION)
        aqk = tl.dot(qi * left, right, acc=aqk, input_precision=PRECISION)
    beta = tl.load(b_ptr + rows * HV + h, mask=below, other=0.0)
    out = sh * C * C + cc[:, None] * C + (j + ii)[None, :]
    keep = (((cc < j) | (cc > r)) & (cc < C))[:, None]                                  # all but block j's rows
    tl.store(a_ptr + out, aqk, mask=keep)
    tl.store(L_ptr + out, beta[:, None] * akk, mask=keep)


@triton.jit
def _intra_chunk_mma_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, index_ptr,
    G_ptr, L_ptr, w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr, DIAG_SLICE: tl.constexpr,
    PRECISION: tl.constexpr, NEUMANN: tl.constexpr, DIAG_COLUMNS: tl.constexpr = False,
):
    # `_intra_chunk_kernel`'s contract and layouts, the products as whole-chunk dots. L_ptr's
    # [C, C] scratch holds L below the diagonal blocks, then T = (I + L)^-1 (its diagonal blocks
    # D_i^-1 written first, block rows i overwriting L's as they are solved)
    sh = tl.program_id(0).to(tl.int64)
    s = sh // HV
    h = sh % HV
    cc = tl.arange(0, BLOCK_C)
    ii = tl.arange(0, BLOCK)
    chunk_k, chunk_v, chunk_c = sh * C * K, sh * C * V, sh * C * C
    _decays(q_ptr, k_ptr, g_ptr, index_ptr, G_ptr, qeg_ptr, kdec_ptr, egc_ptr, s, h, sh, HV, C, K, BLOCK, BLOCK_K)
    tl.debug_barrier()
    # 1. A_qk and L below the diagonal blocks, a column block at a time, every row at once
    for j in tl.static_range(0, C - BLOCK, BLOCK):
        _below_diagonal_columns(G_ptr, q_ptr, k_ptr, b_ptr, index_ptr, a_ptr, L_ptr, s, h, sh, HV, j, C, K, BLOCK_C,
                                BLOCK_K, BLOCK, SLICE, PRECISION)
    if C > BLOCK:                                                       # the last column block: zeros above it
        last = tl.zeros((BLOCK_C, BLOCK), dtype=tl.float32)
        out = chunk_c + cc[:, None] * C + (C - BLOCK + ii)[None, :]
        tl.store(a_ptr + out, last, mask=(cc < C - BLOCK)[:, None])
        tl.store(L_ptr + out, last, mask=(cc < C - BLOCK)[:, None])
    # 2. the diagonal blocks with their exact pairwise decays; their inverses D_i^-1 into T
    strictly_lower = ii[:, None] > ii[None, :]
    for i in range(0, C, BLOCK):
        rows_i = tl.load(index_ptr + s * C + i + ii).to(tl.int64)
        beta = tl.load(b_ptr + rows_i * HV + h)
        if DIAG_COLUMNS:
            akk, aqk = _diagonal_block_by_columns(G_ptr, q_ptr, k_ptr, index_ptr, s, chunk_k, rows_i, i, h, HV, C, K,
                                                  BLOCK, BLOCK_K, DIAG_SLICE)
        else:
            akk, aqk = _diagonal_block(G_ptr, q_ptr, k_ptr, chunk_k, rows_i, i, h, HV, K, BLOCK, BLOCK_K, DIAG_SLICE)
        diag = chunk_c + (i + ii)[:, None] * C + (i + ii)[None, :]
        tl.store(a_ptr + diag, aqk)
        tl.store(L_ptr + diag, _unit_lower_inverse(tl.where(strictly_lower, beta[:, None] * akk, 0.0), BLOCK,
                                                   NEUMANN, PRECISION))
    tl.debug_barrier()
    # 3. T's block rows below the first by block forward substitution:
    #    T_i,<i = -D_i^-1 (L_i,<i T_<i,<i), one [BLOCK, BLOCK_C] x [BLOCK_C, BLOCK_C] dot and one [BLOCK, BLOCK] x
    #    [BLOCK, BLOCK_C]; L_i,<i and T's rows above read from the scratch (rows >= i and columns >= i read 0)
    for i in range(BLOCK, C, BLOCK):
        strip = chunk_c + (i + ii)[:, None] * C + cc[None, :]
        L_i = tl.load(L_ptr + strip, mask=(cc < i)[None, :], other=0.0)                        # [BLOCK, BLOCK_C]
        T_above = tl.load(L_ptr + chunk_c + cc[:, None] * C + cc[None, :],
                          mask=(cc < i)[:, None] & (cc < i)[None, :], other=0.0)              # [BLOCK_C, BLOCK_C]
        Dinv = tl.load(L_ptr + chunk_c + (i + ii)[:, None] * C + (i + ii)[None, :])             # [BLOCK, BLOCK]
        T_i = -tl.dot(Dinv, tl.dot(L_i, T_above, input_precision=PRECISION), input_precision=PRECISION)
        tl.debug_barrier()                                              # L_i read by all before it is overwritten
        tl.store(L_ptr + strip, T_i, mask=(cc < i)[None, :])
        tl.debug_barrier()                                              # T's block row i written before i + 1 reads it
    # 4. W = T (beta e^G k), U = T (beta v): [BLOCK_C, BLOCK_C] x [BLOCK_C, SLICE] dots
    c_in = cc < C
    T = tl.load(L_ptr + chunk_c + cc[:, None] * C + cc[None, :], mask=c_in[:, None] & c_in[None, :], other=0.0)
    rows = tl.load(index_ptr + s * C + cc, mask=c_in, other=0).to(tl.int64)
    beta = tl.load(b_ptr + rows * HV + h, mask=c_in, other=0.0)                                # 0 on padded rows
    ss = tl.arange(0, SLICE)
    for c0 in tl.static_range(0, BLOCK_K, SLICE):
        cs = c0 + ss
        m = c_in[:, None] & (cs < K)[None, :]
        G = tl.load(G_ptr + chunk_k + cc[:, None] * K + cs[None, :], mask=m, other=0.0)
        kb = tl.load(k_ptr + (rows * HV + h)[:, None] * K + cs[None, :], mask=m, other=0.0)
        tl.store(w_ptr + chunk_k + cc[:, None] * K + cs[None, :],
                 tl.dot(T, beta[:, None] * tl.exp(G) * kb, input_precision=PRECISION), mask=m)
    for c0 in tl.static_range(0, BLOCK_V, SLICE):
        cs = c0 + ss
        m = c_in[:, None] & (cs < V)[None, :]
        vb = tl.load(v_ptr + (rows * HV + h)[:, None] * V + cs[None, :], mask=m, other=0.0)
        tl.store(u_ptr + chunk_v + cc[:, None] * V + cs[None, :],
                 tl.dot(T, beta[:, None] * vb, input_precision=PRECISION), mask=m)


def intra_chunk(q, k, v, g, beta, index, *, form=None, precision=None, num_warps=None, slice_=None,
                diag_slice=DIAG_SLICE, neumann=NEUMANN, diag_columns=None):
    """Phase 1 for all chunks at once: `torch_kernels.kda_chunked_blocked.intra_chunk_torch`'s
    contract. q (scaled), k, g [rows, HV, K], v [rows, HV, V], beta [rows, HV]: the packed
    tokens in fp32 with a zero row (what padding reads); index [nseg, C]: each chunk position's
    row. Returns (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)) [nseg, HV, C, K | V | C], eGC
    [nseg, HV, 1, K], fp32.

    C must be a multiple of 16; other dtypes than fp32 (float64) go to the torch version.
    form: "blocks" (FORM, served: `_intra_chunk_kernel`), "mma" (`_intra_chunk_mma_kernel`,
    whole-chunk tensor-core dots) or "split" (`kda_intra_split.intra_chunk_split`, three kernels;
    slice_ its launch 1's key slice, diag_slice unused), the same outputs. Launch options:
    precision (the form's default from PRECISION: "ieee" or "tf32x3"), num_warps (NUM_WARPS /
    MMA_NUM_WARPS), slice_ (the blocks form's dot depth, 16 or 32, SLICE; the mma form's tile
    width over K and V, MMA_SLICE), diag_slice, neumann (the diagonal blocks' inverse as a
    product of powers, else by rows) and diag_columns (the diagonal blocks' exact decays a column
    at a time, `_diagonal_block_by_columns`, instead of as [16, 16, slice] tensors; DIAG_COLUMNS).
    """
    form = form or FORM
    if form not in PRECISION:
        raise ValueError(f"kda intra chunk: form must be one of {sorted(PRECISION)}; got {form!r}")
    precision = precision or PRECISION[form]
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"kda intra chunk: precision must be 'ieee' or 'tf32x3'; got {precision!r}")
    nseg, C = index.shape
    rows, HV, K = q.shape
    V = v.shape[-1]
    if C % BLOCK:
        raise ValueError(f"kda intra chunk: the chunk size must be a multiple of {BLOCK}; got {C}")
    if form == "split":                 # imported here: kda_intra_split imports this module's helpers
        from .kda_intra_split import intra_chunk_split

        return intra_chunk_split(q, k, v, g, beta, index, precision=precision, num_warps=num_warps, slice_=slice_,
                                 neumann=neumann, diag_columns=diag_columns)
    if any(x.dtype != torch.float32 for x in (q, k, v, g, beta)) or not (nseg * HV * K * V):
        return intra_chunk_torch(q, k, v, g, beta, index)
    q, k, v, g, beta, index = (x.contiguous() for x in (q, k, v, g, beta, index))
    dev, f32 = q.device, torch.float32
    G = torch.empty(nseg, HV, C, K, dtype=f32, device=dev)             # scratch: the cumulative log decays
    L = torch.empty(nseg, HV, C, C, dtype=f32, device=dev)             # scratch: beta A_kk (mma: then T)
    W, qeG, kdec = (torch.empty(nseg, HV, C, K, dtype=f32, device=dev) for _ in range(3))
    U = torch.empty(nseg, HV, C, V, dtype=f32, device=dev)
    A_qk = torch.empty(nseg, HV, C, C, dtype=f32, device=dev)
    eGC = torch.empty(nseg, HV, 1, K, dtype=f32, device=dev)
    block_k, block_v = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    common = dict(C=C, K=K, V=V, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK=BLOCK, DIAG_SLICE=min(diag_slice, block_k),
                  PRECISION=precision, NEUMANN=neumann and BLOCK == 16,
                  DIAG_COLUMNS=DIAG_COLUMNS if diag_columns is None else diag_columns)
    args = (q, k, v, g, beta, index, G, L, W, U, A_qk, qeG, kdec, eGC, HV)
    if form == "mma":
        _intra_chunk_mma_kernel[(nseg * HV,)](
            *args, **common, BLOCK_C=max(16, triton.next_power_of_2(C)),
            SLICE=min(slice_ or MMA_SLICE, block_k, block_v), num_warps=num_warps or MMA_NUM_WARPS)
    else:
        _intra_chunk_kernel[(nseg * HV,)](*args, **common, SLICE=min(slice_ or SLICE, block_k),
                                          num_warps=num_warps or NUM_WARPS)
    return W, U, A_qk, qeG, kdec, eGC
