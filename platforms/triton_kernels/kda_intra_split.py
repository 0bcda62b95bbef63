"""Phase 1 of the batched chunked KDA prefill in three kernels (four launches) with wide grids and
short dependency chains: `kda_intra_chunk.intra_chunk`'s contract (`intra_chunk(form="split")`).

The one-launch forms give each (chunk, head) one program that walks a long serial chain of
16 x 16 dots and CTA barriers (5.89 ms at 8K tokens and 96 heads on an H100, 2-3 programs an
SM). Here the work is cut where its dependencies are, one program per piece:

1. `_split_blocks_kernel`, a program per (chunk, head, 16-row block i) (C / 16 per chunk): the
   block's decays and row block i of A. G, the cumulative log decay, is needed only as
   differences from a reference inside the chunk, so each program sums the chunk's g itself
   (no G scratch): G_ref, the G before block i (the sum of the rows before), the block's local
   cumulative sum lc = G_a - G_ref and the chunk's tail. It writes the block's rows of q e^G
   and k e^(G_C - G) (and e^(G_C), block 0), row block i of A_qk, L = beta A_kk's blocks left of
   the diagonal and, on the diagonal, D_i^-1 = (I + L_ii)^-1 (`_unit_lower_inverse`: six
   16 x 16 dots and a Newton step). A's columns left of block i are one [16, SLICE] x
   [SLICE, C] dot per key slice with both sides scaled to G_ref, e^(G_a - G_ref) <= 1 and
   e^(G_ref - G_j) <= 1 (nothing overflows whatever the gate); the diagonal block keeps its
   exact pairwise decays, masked to -inf above the diagonal before the exponential,
   elementwise in fp32 (as `_diagonal_block`).
2. `_split_solve_kernel`, a program per (chunk, head): T = (I + L)^-1 below its diagonal blocks
   by block forward substitution, T_i,<i = -D_i^-1 (L_i,<i T_<i,<i), a [16, C] x [C, C] and a
   [16, 16] x [16, C] dot per block row (C / 16 - 1 rows: a chain of 6 dots at C = 64), T
   overwriting L in the scratch.
3. `_split_wu_kernel`, two launches (W, then U), a program per (chunk, head, column slice):
   W = T (beta e^G k) and U = T (beta v), [C, W_SLICE] accumulated over T's 16-column blocks
   ([C, 16] x [16, W_SLICE] dots; G again a cumulative sum of g).

DRAM bytes at K3's C = 64, K = V = 128 (per (chunk, head): [C, K] fp32 = 32 KB): kernel 1 reads
q, k, g and writes q e^G, k e^(G_C - G), A_qk and L (192 KB; its programs reread the chunk's g
and the keys above their block, from L2); kernel 2 reads L and writes T (32 KB); kernel 3 reads
T (once; the slices' programs share it in L2), g, k, v and writes W, U (176 KB): 400 KB against
the contract's 272 KB, 4.9 GB at 8K tokens and 96 heads (about 1.5 ms at 3.3 TB/s).

Products: `tl.dot` with `input_precision`. PRECISION (A's blocks left of the diagonal and
W, U: the wide dots) is 3xTF32 by default ("tf32x3", as accurate as fp32 for this chain in
bench/kda_tf32_sensitivity.py), "ieee" (fp32 FMAs) a launch option; SOLVE_PRECISION (the
16-row inverses and T's substitution: small, latency-bound dots) is "ieee" by default.

sm_90a (bench/ptxas_report.py; C = 64, K = V = 128, 4 warps, tf32x3): kernel 1 168 registers
(4 B spilled; 128 and none at 8 warps), kernel 2 113, kernel 3 158 (W) and 170 (U), none spilled.
On an H100 at 8K tokens and 96 heads (bench/kda_prefill.py) the split form takes 9.0 ms against
5.9 ms for the one-launch blocks form: kernel 1 alone 8.7 ms. Nsight Compute (bench/kda_prefill_ncu.py)
shows both bound by L1 / shared-memory traffic, not by latency: kernel 1 at 81% of L1 throughput with
42% of its cycles stalled on shared-memory (MIO) operations, the blocks kernel at 88% with 1.3 M
local-memory spill requests; the [16, 16, SLICE] broadcasts of the diagonal decays go through shared
memory. DIAG_COLUMNS computes the diagonal block a column at a time instead (no 3-D tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels.kda_chunked_blocked import intra_chunk_torch

from .kda_intra_chunk import BLOCK, NEUMANN, _unit_lower_inverse

SLICE = 16                    # kernel 1: key channels per step (the diagonal's [16, 16, SLICE] decays)
W_SLICE = 64                  # kernel 3: columns of W or U per program ([C, 16] x [16, W_SLICE] dots, summed)
PRECISION = "tf32x3"          # A's blocks left of the diagonal and W, U
SOLVE_PRECISION = "ieee"      # the 16-row inverses and T's block forward substitution
NUM_WARPS = 4                 # every launch
DIAG_COLUMNS = False          # kernel 1's diagonal block a column at a time (no [16, 16, SLICE] tensors): the
                              # split form 7.59 against 8.72 ms on an H100 (bench/kda_prefill_ncu.py)


@triton.jit
def _split_blocks_kernel(
    q_ptr, k_ptr, g_ptr, b_ptr, index_ptr, a_ptr, t_ptr, qeg_ptr, kdec_ptr, egc_ptr, HV,
    C: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
    SLICE: tl.constexpr, PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr, NEUMANN: tl.constexpr,
    DIAG_COLUMNS: tl.constexpr = False,
):
    # One program per (chunk s, head h, row block i), i fastest (a chunk's programs share its g
    # and keys in L2). Packed rows, contiguous: q, k, g [rows, HV, K]; beta [rows, HV]; index
    # [nseg, C]. Out: q e^G, k e^(G_C - G) [nseg, HV, C, K] (block i's rows), e^(G_C) [nseg, HV, K]
    # (block 0), A_qk [nseg, HV, C, C] (block row i) and the scratch [nseg, HV, C, C]: L's blocks
    # left of the diagonal, D_i^-1 on it (nothing right of it)
    pid = tl.program_id(0).to(tl.int64)
    NB: tl.constexpr = C // BLOCK
    sh = pid // NB
    i0 = (pid % NB) * BLOCK                                             # block i's first row
    s = sh // HV
    h = sh % HV
    ii = tl.arange(0, BLOCK)
    cc = tl.arange(0, BLOCK_C)
    ss = tl.arange(0, SLICE)
    in_c = cc < C
    before = cc < i0                                                    # the rows of the blocks left of i
    after = (cc >= i0 + BLOCK) & in_c
    rows_i = tl.load(index_ptr + s * C + i0 + ii).to(tl.int64)          # [BLOCK] packed rows
    rows = tl.load(index_ptr + s * C + cc, mask=in_c, other=0).to(tl.int64)   # [BLOCK_C]
    lower = ii[:, None] >= ii[None, :]
    akk = tl.zeros((BLOCK, BLOCK_C), dtype=tl.float32)                  # left of the diagonal block
    aqk = tl.zeros((BLOCK, BLOCK_C), dtype=tl.float32)
    dkk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)                    # the diagonal block
    dqk = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for c0 in tl.range(0, BLOCK_K, SLICE, num_stages=1):              # not pipelined: 255 registers if it is
        cs = c0 + ss
        c_in = (cs < K)[None, :]
        src_i = (rows_i * HV + h)[:, None] * K + cs[None, :]
        gi = tl.load(g_ptr + src_i, mask=c_in, other=0.0)               # [BLOCK, SLICE]
        ki = tl.load(k_ptr + src_i, mask=c_in, other=0.0)
        qi = tl.load(q_ptr + src_i, mask=c_in, other=0.0)
        src = (rows * HV + h)[:, None] * K + cs[None, :]
        g_all = tl.load(g_ptr + src, mask=in_c[:, None] & c_in, other=0.0)           # [BLOCK_C, SLICE]
        g_before = tl.where(before[:, None], g_all, 0.0)
        G_ref = tl.sum(g_before, 0)                                     # [SLICE] G at row i0 - 1
        tail = tl.sum(tl.where(after[:, None], g_all, 0.0), 0)          # G_C - G at the block's last row
        lc = tl.cumsum(gi, 0)                                           # G_a - G_ref, <= 0
        # the decays of the block's rows: q e^G, k e^(G_C - G) (the sum of g after row a), e^(G_C)
        dst = sh * C * K + (i0 + ii)[:, None] * K + cs[None, :]
        tl.store(qeg_ptr + dst, qi * tl.exp(G_ref[None, :] + lc), mask=c_in)
        tl.store(kdec_ptr + dst, ki * tl.exp(tail[None, :] + (tl.cumsum(gi, 0, reverse=True) - gi)), mask=c_in)
        tl.store(egc_ptr + sh * K + cs, tl.exp(tl.sum(g_all, 0)), mask=(cs < K) & (i0 == 0))
        # the columns left of the block: k_j e^(G_ref - G_j) (the sum of g over j < t < i0) <= 1
        kb = tl.load(k_ptr + src, mask=before[:, None] & c_in, other=0.0)             # [BLOCK_C, SLICE]
        right = kb * tl.exp(tl.where(before[:, None], tl.cumsum(g_before, 0, reverse=True) - g_before,
                                     float("-inf")))
        left = tl.exp(lc)                                               # [BLOCK, SLICE], <= 1
        akk = tl.dot(ki * left, tl.trans(right), acc=akk, input_precision=PRECISION)
        aqk = tl.dot(qi * left, tl.trans(right), acc=aqk, input_precision=PRECISION)
        # the diagonal block: exact pairwise decays e^(lc_a - lc_b), a >= b
        if DIAG_COLUMNS:                # a column b at a time: row b's g summed as it goes, its k a vector
            lc_b = tl.zeros((SLICE,), dtype=tl.float32)
            for b in range(BLOCK):
                src_b = (tl.load(index_ptr + s * C + i0 + b).to(tl.int64) * HV + h) * K + cs
                lc_b += tl.load(g_ptr + src_b, mask=cs < K, other=0.0)
                k_b = tl.load(k_ptr + src_b, mask=cs < K, other=0.0)
                decayed = tl.exp(tl.where(ii[:, None] >= b, lc - lc_b[None, :], float("-inf"))) * k_b[None, :]
                column = ii[None, :] == b
                dkk += tl.where(column, tl.sum(ki * decayed, 1)[:, None], 0.0)
                dqk += tl.where(column, tl.sum(qi * decayed, 1)[:, None], 0.0)
        else:
            decay = tl.exp(tl.where(lower[:, :, None], lc[:, None, :] - lc[None, :, :], float("-inf")))
            kd = decay * ki[None, :, :]                                 # [a, b, slice]: e^(G_a - G_b) k_b
            dkk += tl.sum(ki[:, None, :] * kd, axis=2)
            dqk += tl.sum(qi[:, None, :] * kd, axis=2)
    beta = tl.load(b_ptr + rows_i * HV + h)                             # [BLOCK]
    row = sh * C * C + (i0 + ii)[:, None] * C
    # A_qk's block row: the columns left of the block and the zeros right of it (right of the
    # block `right` was 0), then the diagonal block (0 above the diagonal): disjoint stores
    tl.store(a_ptr + row + cc[None, :], aqk, mask=(before | after)[None, :])
    tl.store(a_ptr + row + (i0 + ii)[None, :], dqk)
    tl.store(t_ptr + row + cc[None, :], beta[:, None] * akk, mask=before[None, :])
    L_ii = tl.where(ii[:, None] > ii[None, :], beta[:, None] * dkk, 0.0)
    tl.store(t_ptr + row + (i0 + ii)[None, :], _unit_lower_inverse(L_ii, BLOCK, NEUMANN, SOLVE_PRECISION))


@triton.jit
def _split_solve_kernel(t_ptr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
                        SOLVE_PRECISION: tl.constexpr):
    # One program per (chunk, head): the scratch [nseg, HV, C, C] holds L left of the diagonal
    # blocks and D_i^-1 on them; T = (I + L)^-1's block rows below the first overwrite L's,
    # T_i,<i = -D_i^-1 (L_i,<i T_<i,<i) (T's rows above read back, a CTA barrier apart)
    sh = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, BLOCK_C)
    ii = tl.arange(0, BLOCK)
    chunk_c = sh * C * C
    blk = cc // BLOCK
    written = blk[None, :] <= blk[:, None]                              # block lower triangle: T's part
    for i in range(BLOCK, C, BLOCK):
        strip = chunk_c + (i + ii)[:, None] * C + cc[None, :]
        L_i = tl.load(t_ptr + strip, mask=(cc < i)[None, :], other=0.0)                     # [BLOCK, BLOCK_C]
        T_above = tl.load(t_ptr + chunk_c + cc[:, None] * C + cc[None, :],
                          mask=(cc < i)[:, None] & (cc < i)[None, :] & written, other=0.0)   # [BLOCK_C, BLOCK_C]
        Dinv = tl.load(t_ptr + chunk_c + (i + ii)[:, None] * C + (i + ii)[None, :])           # [BLOCK, BLOCK]
        T_i = -tl.dot(Dinv, tl.dot(L_i, T_above, input_precision=SOLVE_PRECISION), input_precision=SOLVE_PRECISION)
        tl.debug_barrier()                                              # L_i read by all before it is overwritten
        tl.store(t_ptr + strip, T_i, mask=(cc < i)[None, :])
        tl.debug_barrier()                                              # T's block row i written before i + 1 reads it


@triton.jit
def _split_wu_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, index_ptr, t_ptr, w_ptr, u_ptr, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
    W_SLICE: tl.constexpr, IS_W: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program per (chunk s, head h, column slice n) of W (IS_W) or U, n fastest (a chunk's
    # programs share T in L2): columns n W_SLICE onwards. T (the scratch's block lower triangle)
    # [C, C]; W [nseg, HV, C, K], U [nseg, HV, C, V]. The dot's depth 16 rows at a time (an
    # fp32-FMA dot holds its whole depth per thread)
    D: tl.constexpr = K if IS_W else V                                  # W's or U's width
    NS: tl.constexpr = (D + W_SLICE - 1) // W_SLICE
    pid = tl.program_id(0).to(tl.int64)
    sh = pid // NS
    n = pid % NS
    s = sh // HV
    h = sh % HV
    cc = tl.arange(0, BLOCK_C)
    ii = tl.arange(0, BLOCK)
    ww = tl.arange(0, W_SLICE)
    in_c = cc < C
    blk = cc // BLOCK
    cs = n * W_SLICE + ww
    c_in = (cs < D)[None, :]
    acc = tl.zeros((BLOCK_C, W_SLICE), dtype=tl.float32)
    G_end = tl.zeros((W_SLICE,), dtype=tl.float32)                      # G at the end of the blocks before
    for b0 in tl.static_range(0, C, BLOCK):                             # the dot's depth a 16-row block at a time
        rows = tl.load(index_ptr + s * C + b0 + ii).to(tl.int64)        # [BLOCK] packed rows
        beta = tl.load(b_ptr + rows * HV + h)
        if IS_W:                                                        # beta e^G k
            src = (rows * HV + h)[:, None] * K + cs[None, :]
            g = tl.load(g_ptr + src, mask=c_in, other=0.0)              # [BLOCK, W_SLICE]
            R = beta[:, None] * tl.exp(G_end[None, :] + tl.cumsum(g, 0)) * tl.load(k_ptr + src, mask=c_in, other=0.0)
            G_end += tl.sum(g, 0)
        else:                                                           # beta v
            R = beta[:, None] * tl.load(v_ptr + (rows * HV + h)[:, None] * V + cs[None, :], mask=c_in, other=0.0)
        T_b = tl.load(t_ptr + sh * C * C + cc[:, None] * C + (b0 + ii)[None, :],
                      mask=in_c[:, None] & (b0 // BLOCK <= blk[:, None]), other=0.0)   # [BLOCK_C, BLOCK] of T
        acc = tl.dot(T_b, R, acc=acc, input_precision=PRECISION)
    out = sh * C * D + cc[:, None] * D + cs[None, :]
    tl.store((w_ptr if IS_W else u_ptr) + out, acc, mask=in_c[:, None] & c_in)


def _check_precision(name, value):
    if value not in ("ieee", "tf32x3"):
        raise ValueError(f"kda intra chunk split: {name} must be 'ieee' or 'tf32x3'; got {value!r}")


def intra_chunk_split(q, k, v, g, beta, index, *, precision=None, solve_precision=None, num_warps=None,
                      slice_=None, w_slice=None, neumann=NEUMANN, diag_columns=None):
    """Phase 1 for all chunks at once in three kernels (four launches): `intra_chunk`'s contract
    (q (scaled), k, g [rows, HV, K], v [rows, HV, V], beta [rows, HV] fp32 with a zero row;
    index [nseg, C]; returns (W, U, A_qk, q e^G, k e^(G_C - G), e^(G_C)) [nseg, HV, C, K | V | C],
    eGC [nseg, HV, 1, K]). C must be a multiple of 16; other dtypes than fp32 go to the torch
    version. Launch options: precision (A's blocks left of the diagonal and W, U; PRECISION),
    solve_precision (the 16-row inverses and T's substitution; SOLVE_PRECISION), each "ieee" or
    "tf32x3"; num_warps (every launch, NUM_WARPS); slice_ (kernel 1's key channels a step, 16 or
    32, SLICE); w_slice (kernel 3's columns a program, W_SLICE); neumann (the diagonal blocks'
    inverse as a product of powers, else by rows); diag_columns (kernel 1's diagonal block a column
    at a time instead of as [16, 16, SLICE] tensors; DIAG_COLUMNS).
    """
    precision = precision or PRECISION
    solve_precision = solve_precision or SOLVE_PRECISION
    _check_precision("precision", precision)
    _check_precision("solve_precision", solve_precision)
    nseg, C = index.shape
    rows, HV, K = q.shape
    V = v.shape[-1]
    if C % BLOCK:
        raise ValueError(f"kda intra chunk split: the chunk size must be a multiple of {BLOCK}; got {C}")
    if any(x.dtype != torch.float32 for x in (q, k, v, g, beta)) or not (nseg * HV * K * V):
        return intra_chunk_torch(q, k, v, g, beta, index)
    q, k, v, g, beta, index = (x.contiguous() for x in (q, k, v, g, beta, index))
    dev, f32 = q.device, torch.float32
    T = torch.empty(nseg, HV, C, C, dtype=f32, device=dev)             # scratch: L and D_i^-1, then T
    W, qeG, kdec = (torch.empty(nseg, HV, C, K, dtype=f32, device=dev) for _ in range(3))
    U = torch.empty(nseg, HV, C, V, dtype=f32, device=dev)
    A_qk = torch.empty(nseg, HV, C, C, dtype=f32, device=dev)
    eGC = torch.empty(nseg, HV, 1, K, dtype=f32, device=dev)
    block_c = max(16, triton.next_power_of_2(C))
    block_k = max(16, triton.next_power_of_2(K))
    warps = num_warps or NUM_WARPS
    _split_blocks_kernel[(nseg * HV * (C // BLOCK),)](
        q, k, g, beta, index, A_qk, T, qeG, kdec, eGC, HV, C=C, K=K, BLOCK_C=block_c, BLOCK_K=block_k, BLOCK=BLOCK,
        SLICE=min(slice_ or SLICE, block_k), PRECISION=precision, SOLVE_PRECISION=solve_precision,
        NEUMANN=neumann and BLOCK == 16, DIAG_COLUMNS=DIAG_COLUMNS if diag_columns is None else diag_columns,
        num_warps=warps)
    if C > BLOCK:
        _split_solve_kernel[(nseg * HV,)](T, C=C, BLOCK_C=block_c, BLOCK=BLOCK, SOLVE_PRECISION=solve_precision,
                                          num_warps=warps)
    cols = min(w_slice or W_SLICE, max(16, triton.next_power_of_2(max(K, V))))
    for is_w, width in ((True, K), (False, V)):
        _split_wu_kernel[(nseg * HV * triton.cdiv(width, cols),)](
            k, v, g, beta, index, T, W, U, HV, C=C, K=K, V=V, BLOCK_C=block_c, BLOCK=BLOCK, W_SLICE=cols, IS_W=is_w,
            PRECISION=precision, num_warps=warps)
    return W, U, A_qk, qeG, kdec, eGC
