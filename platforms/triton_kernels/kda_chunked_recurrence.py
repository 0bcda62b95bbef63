"""Phase 2 of the batched chunked KDA prefill (`torch_kernels/kda_chunked_blocked.py`), the state
recurrence across chunks, in one Triton launch: `recurrence_torch`'s contract, which walks it in
one round of batched matmuls per chunk index (about 6 launches a round, 128 rounds for an 8K
prompt in chunks of 64: host-bound on an H200).

One program per (BLOCK_V columns of the state, sequence x value head): it walks the sequence's
chunks in order with its [K, BLOCK_V] slice of the fp32 state S, per chunk c

    delta = U_c[:, cols] - W_c @ S                  [C, BLOCK_V]
    o_c[:, cols] = qeG_c @ S + A_qk_c @ delta       [C, BLOCK_V]
    S = eGC_c[:, None] * S + kdec_c^T @ delta       [K, BLOCK_V]

storing S to the chunk's checkpoint slot when its end is wanted, and the final S. The columns of
the state are independent (every product mixes rows only), so the V blocks need no exchange.
Which segments are a sequence's chunks, and which slots their ends go to, are two [N, R] int32
tables (R: the most chunks of a sequence, -1 padded) uploaded once; the programs read them on
the device, so the launch is the same whatever the chunk counts.

Two kernels, by the dots' precision (`recurrence(precision=...)`):

- "tf32x3" (served by `kda_chunked_blocked`): `_recurrence_mma_kernel`, three TF32 tensor-core
  products per dot (as accurate as fp32 for this chain in bench/kda_tf32_sensitivity.py, where
  plain TF32 is not; it passes the H200's conformance cases). Tensor-core accumulators are spread
  over the CTA, so S stays in registers across chunks, as two halves of K rows so the operands,
  split three ways, fit: no scratch, no barriers. 4.2 ms at 8K tokens and 96 heads on the H200
  (BLOCK_V = 32, 4 warps: 255 registers, 60 B spilled; 16 columns: 4.9 ms, no spills).
- "ieee" (exact fp32 FMAs): `_recurrence_kernel`, 15.4 ms on the same shapes. Triton's fp32 FMA
  dots hold their whole depth per thread, so S in registers would make W_c @ S a 128-deep dot
  and spill kilobytes a thread at K = 128 (ptxas, sm_90a: 1.6 KB at BLOCK_V = 32 and 8 warps, 20
  KB at 4 warps). S is kept instead in the program's own scratch (`work`, 2 x [K, BLOCK_V]
  ping-pong + delta [C, BLOCK_V]: 40 KB a program at K3's shapes, L1 / L2 resident), and every
  dot is SLICE (16) deep over K or C slices, with a CTA barrier after delta is written and one
  at the end of each chunk. Launch: BLOCK_V = 32 and 8 warps (184 registers, no spills).

Either kernel has an O_ROWS twin (`_recurrence_rows_kernel`, `_recurrence_mma_rows_kernel`;
`recurrence(out=, out_index=)`) that writes o straight to the packed token rows through the
chunk index, in o's dtype, instead of o_chunks: the glue's scatter copy (and the cast after it)
are then not needed. Not yet timed on a GPU.

Dimensions that are not powers of two (or under 16, tl.dot's least) are padded with masked loads
reading 0, which leaves S's padded rows 0 (eGC and kdec read 0 there) and delta's padded rows 0
(U and W read 0). bench/ptxas_report.py compiles the launched tiles for sm_90a.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels.kda_chunked_blocked import recurrence_torch

BLOCK_V = 32
NUM_WARPS = 8
SLICE = 16                    # the depth of every dot (K and C are walked in slices of it)
MMA_BLOCK_V = 32              # the tensor-core form's launch (4 warps): 255 registers, 60 B spilled at K3's shapes;
                              # 16 (227, none) took 6.1 ms at 8K tokens on the H200 against 4.5 (bench/kda_prefill.py)
MMA_NUM_WARPS = 4


@triton.jit
def _store_o(o_ptr, idx_ptr, o, seg, sh, h, HV, n_out, cc, vv, c_in, v_in, C: tl.constexpr, V: tl.constexpr,
             O_ROWS: tl.constexpr):
    """Chunk seg's o [BLOCK_C, BLOCK_V]: to its [C, V] tile of o_chunks [nseg, HV, C, V], or with
    O_ROWS straight to the packed rows idx[seg, c] of o [n_out, HV, V] in o's dtype (rows >= n_out,
    the padding, dropped)."""
    if O_ROWS:
        rows = tl.load(idx_ptr + seg * C + cc, mask=c_in, other=n_out)                    # [BLOCK_C] int64
        tl.store(o_ptr + (rows * HV + h)[:, None] * V + vv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=(rows < n_out)[:, None] & v_in[None, :])
    else:
        tl.store(o_ptr + sh * C * V + cc[:, None] * V + vv[None, :], o, mask=c_in[:, None] & v_in[None, :])


@triton.jit
def _recurrence_body(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr, work_ptr,
    idx_ptr, n_out, HV, R,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SLICE: tl.constexpr,
    PRECISION: tl.constexpr, O_ROWS: tl.constexpr,
):
    # all tensors contiguous: W, qeG, kdec [nseg, HV, C, K]; U, o [nseg, HV, C, V];
    # A [nseg, HV, C, C]; eGC [nseg, HV, 1, K]; h0, ht [N, HV, K, V]; ckpt [slots, HV, K, V];
    # seg, slot [N, R] int32 (-1 past a sequence's chunks / where no checkpoint); work: this
    # program's scratch, two [BLOCK_K, BLOCK_V] states (ping-pong) and a [BLOCK_C, BLOCK_V] delta
    nh = tl.program_id(1).to(tl.int64)
    n = nh // HV
    h = nh % HV
    work = work_ptr + (nh * tl.num_programs(0) + tl.program_id(0)) * (2 * BLOCK_K + BLOCK_C) * BLOCK_V
    d_work = work + 2 * BLOCK_K * BLOCK_V                                   # delta [BLOCK_C, BLOCK_V]
    cc = tl.arange(0, BLOCK_C)                                              # chunk rows
    ss = tl.arange(0, SLICE)                                                # a slice of K or C
    bv = tl.arange(0, BLOCK_V)
    vv = tl.program_id(0) * BLOCK_V + bv                                    # the state's columns
    c_in, v_in = cc < C, vv < V
    cv_in = c_in[:, None] & v_in[None, :]

    # the state in registers between chunks would make every dot K deep (fp32 FMA dots hold
    # their whole depth per thread: hundreds of registers spilled); it is kept in this program's
    # scratch (L1-resident) instead, and every dot is SLICE deep
    for k0 in tl.static_range(0, BLOCK_K, SLICE):
        kk = k0 + ss
        tile = kk[:, None] * V + vv[None, :]
        inside = (kk < K)[:, None] & v_in[None, :]
        tl.store(work + kk[:, None] * BLOCK_V + bv[None, :],
                 tl.load(h0_ptr + nh * K * V + tile, mask=inside, other=0.0))
    tl.debug_barrier()
    # a while loop over the sequence's chunks: the interpreter takes no runtime bound in range(),
    # and the chunk count is read on the device (its table row ends at R or the first -1)
    r = 0
    seg = tl.load(seg_ptr + n * R).to(tl.int64)                             # R >= 1
    while seg >= 0:
        sh = seg * HV + h                                                   # the chunk's (segment, head)
        s_old = work + (r % 2) * BLOCK_K * BLOCK_V
        s_new = work + ((r + 1) % 2) * BLOCK_K * BLOCK_V
        delta = tl.load(u_ptr + sh * C * V + cc[:, None] * V + vv[None, :], mask=cv_in, other=0.0)
        o = tl.zeros((BLOCK_C, BLOCK_V), dtype=tl.float32)
        for k0 in tl.static_range(0, BLOCK_K, SLICE):                      # delta = U - W S, o = qeG S
            kk = k0 + ss
            ck = sh * C * K + cc[:, None] * K + kk[None, :]
            ck_in = c_in[:, None] & (kk < K)[None, :]
            Sk = tl.load(s_old + kk[:, None] * BLOCK_V + bv[None, :])      # [SLICE, BLOCK_V]
            delta -= tl.dot(tl.load(w_ptr + ck, mask=ck_in, other=0.0), Sk, input_precision=PRECISION)
            o = tl.dot(tl.load(qeg_ptr + ck, mask=ck_in, other=0.0), Sk, acc=o, input_precision=PRECISION)
        tl.store(d_work + cc[:, None] * BLOCK_V + bv[None, :], delta)
        tl.debug_barrier()
        for c0 in tl.static_range(0, BLOCK_C, SLICE):                      # o += A_qk delta
            cs = c0 + ss
            A = tl.load(a_ptr + sh * C * C + cc[:, None] * C + cs[None, :],
                        mask=c_in[:, None] & (cs < C)[None, :], other=0.0)  # [BLOCK_C, SLICE]
            D = tl.load(d_work + cs[:, None] * BLOCK_V + bv[None, :])       # [SLICE, BLOCK_V]
            o = tl.dot(A, D, acc=o, input_precision=PRECISION)
        _store_o(o_ptr, idx_ptr, o, seg, sh, h, HV, n_out, cc, vv, c_in, v_in, C, V, O_ROWS)
        slot = tl.load(slot_ptr + n * R + r).to(tl.int64)
        for k0 in tl.static_range(0, BLOCK_K, SLICE):                      # S = eGC S + kdec^T delta
            kk = k0 + ss
            k_in = kk < K
            decay = tl.load(egc_ptr + sh * K + kk, mask=k_in, other=0.0)   # 0 on padded rows
            Sk = decay[:, None] * tl.load(s_old + kk[:, None] * BLOCK_V + bv[None, :])
            for c0 in tl.static_range(0, BLOCK_C, SLICE):
                cs = c0 + ss
                KT = tl.load(kdec_ptr + sh * C * K + cs[None, :] * K + kk[:, None],
                             mask=k_in[:, None] & (cs < C)[None, :], other=0.0)   # [SLICE k, SLICE c]
                D = tl.load(d_work + cs[:, None] * BLOCK_V + bv[None, :])
                Sk = tl.dot(KT, D, acc=Sk, input_precision=PRECISION)
            tl.store(s_new + kk[:, None] * BLOCK_V + bv[None, :], Sk)
            if slot >= 0:
                tl.store(ckpt_ptr + (slot * HV + h) * K * V + kk[:, None] * V + vv[None, :], Sk,
                         mask=k_in[:, None] & v_in[None, :])
        tl.debug_barrier()              # s_new and d_work complete before the next chunk reads them
        r += 1
        seg = tl.load(seg_ptr + n * R + r, mask=r < R, other=-1).to(tl.int64)
    s_last = work + (r % 2) * BLOCK_K * BLOCK_V
    for k0 in tl.static_range(0, BLOCK_K, SLICE):
        kk = k0 + ss
        tl.store(ht_ptr + nh * K * V + kk[:, None] * V + vv[None, :],
                 tl.load(s_last + kk[:, None] * BLOCK_V + bv[None, :]), mask=(kk < K)[:, None] & v_in[None, :])


@triton.jit
def _recurrence_mma_body(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr,
    idx_ptr, n_out, HV, R,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    O_ROWS: tl.constexpr,
):
    # `_recurrence_kernel`'s contract and layouts with tensor-core dots (PRECISION "tf32x3"):
    # their accumulators are spread over the CTA, so the state stays in registers across chunks
    # (no scratch, no barriers), as two halves of K rows (S1, S2: [HALF, BLOCK_V]) so that each
    # dot's operands, split three ways by 3xTF32, fit the registers
    HALF: tl.constexpr = BLOCK_K // 2
    nh = tl.program_id(1).to(tl.int64)
    n = nh // HV
    h = nh % HV
    cc = tl.arange(0, BLOCK_C)
    k1 = tl.arange(0, HALF)
    k2 = HALF + k1
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    c_in, v_in = cc < C, vv < V
    cv_in = c_in[:, None] & v_in[None, :]
    S1 = tl.load(h0_ptr + nh * K * V + k1[:, None] * V + vv[None, :], mask=(k1 < K)[:, None] & v_in[None, :],
                 other=0.0)                                                 # [HALF, BLOCK_V]
    S2 = tl.load(h0_ptr + nh * K * V + k2[:, None] * V + vv[None, :], mask=(k2 < K)[:, None] & v_in[None, :],
                 other=0.0)
    r = 0
    seg = tl.load(seg_ptr + n * R).to(tl.int64)                             # R >= 1
    while seg >= 0:
        sh = seg * HV + h
        base_ck = sh * C * K + cc[:, None] * K
        m1 = c_in[:, None] & (k1 < K)[None, :]
        m2 = c_in[:, None] & (k2 < K)[None, :]
        delta = tl.load(u_ptr + sh * C * V + cc[:, None] * V + vv[None, :], mask=cv_in, other=0.0)
        delta -= tl.dot(tl.load(w_ptr + base_ck + k1[None, :], mask=m1, other=0.0), S1, input_precision=PRECISION)
        delta -= tl.dot(tl.load(w_ptr + base_ck + k2[None, :], mask=m2, other=0.0), S2, input_precision=PRECISION)
        o = tl.dot(tl.load(qeg_ptr + base_ck + k1[None, :], mask=m1, other=0.0), S1, input_precision=PRECISION)
        o = tl.dot(tl.load(qeg_ptr + base_ck + k2[None, :], mask=m2, other=0.0), S2, acc=o,
                   input_precision=PRECISION)
        A = tl.load(a_ptr + sh * C * C + cc[:, None] * C + cc[None, :], mask=c_in[:, None] & c_in[None, :],
                    other=0.0)                                              # [BLOCK_C, BLOCK_C]
        o = tl.dot(A, delta, acc=o, input_precision=PRECISION)
        _store_o(o_ptr, idx_ptr, o, seg, sh, h, HV, n_out, cc, vv, c_in, v_in, C, V, O_ROWS)
        d1 = tl.load(egc_ptr + sh * K + k1, mask=k1 < K, other=0.0)        # 0 on padded rows
        d2 = tl.load(egc_ptr + sh * K + k2, mask=k2 < K, other=0.0)
        KT1 = tl.load(kdec_ptr + sh * C * K + cc[None, :] * K + k1[:, None], mask=(k1 < K)[:, None] & c_in[None, :],
                      other=0.0)                                            # [HALF, BLOCK_C]
        S1 = tl.dot(KT1, delta, acc=d1[:, None] * S1, input_precision=PRECISION)
        KT2 = tl.load(kdec_ptr + sh * C * K + cc[None, :] * K + k2[:, None], mask=(k2 < K)[:, None] & c_in[None, :],
                      other=0.0)
        S2 = tl.dot(KT2, delta, acc=d2[:, None] * S2, input_precision=PRECISION)
        slot = tl.load(slot_ptr + n * R + r).to(tl.int64)
        if slot >= 0:
            dst = ckpt_ptr + (slot * HV + h) * K * V + vv[None, :]
            tl.store(dst + k1[:, None] * V, S1, mask=(k1 < K)[:, None] & v_in[None, :])
            tl.store(dst + k2[:, None] * V, S2, mask=(k2 < K)[:, None] & v_in[None, :])
        r += 1
        seg = tl.load(seg_ptr + n * R + r, mask=r < R, other=-1).to(tl.int64)
    tl.store(ht_ptr + nh * K * V + k1[:, None] * V + vv[None, :], S1, mask=(k1 < K)[:, None] & v_in[None, :])
    tl.store(ht_ptr + nh * K * V + k2[:, None] * V + vv[None, :], S2, mask=(k2 < K)[:, None] & v_in[None, :])


# The launched kernels: each body as it was (o to o_chunks), and with O_ROWS (o through the index)


@triton.jit
def _recurrence_kernel(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr, work_ptr,
    HV, R, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, SLICE: tl.constexpr, PRECISION: tl.constexpr,
):
    _recurrence_body(w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr,
                     ckpt_ptr, work_ptr, o_ptr, 0, HV, R, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V, SLICE, PRECISION, False)


@triton.jit
def _recurrence_rows_kernel(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr, work_ptr,
    idx_ptr, n_out, HV, R, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SLICE: tl.constexpr, PRECISION: tl.constexpr,
):
    _recurrence_body(w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr,
                     ckpt_ptr, work_ptr, idx_ptr, n_out, HV, R, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V, SLICE, PRECISION,
                     True)


@triton.jit
def _recurrence_mma_kernel(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr,
    HV, R, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    _recurrence_mma_body(w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr,
                         ckpt_ptr, o_ptr, 0, HV, R, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V, PRECISION, False)


@triton.jit
def _recurrence_mma_rows_kernel(
    w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr, ckpt_ptr,
    idx_ptr, n_out, HV, R, C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    _recurrence_mma_body(w_ptr, u_ptr, a_ptr, qeg_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, o_ptr, ht_ptr,
                         ckpt_ptr, idx_ptr, n_out, HV, R, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V, PRECISION, True)


def tables(order, sizes, capture, device):
    """The per-sequence tables the kernel reads, from `_segments`' round-major structure: an int32
    [2, N, R] tensor on `device` (one upload), [0] the segment of each sequence's r-th chunk and
    [1] the checkpoint slot its end goes to (the index in `capture`), both -1 where none."""
    N, R = len(order), len(sizes)
    table = torch.full((2, N, R), -1, dtype=torch.int32)
    seg = torch.arange(sum(sizes), dtype=torch.int32)
    s0 = 0
    for r, size in enumerate(sizes):                    # round r: the first `size` of `order`
        table[0, order[:size], r] = seg[s0: s0 + size]
        s0 += size
    if len(capture):
        at = torch.full((sum(sizes),), -1, dtype=torch.int32)
        at[torch.as_tensor(list(capture), dtype=torch.long)] = torch.arange(len(capture), dtype=torch.int32)
        table[1] = torch.where(table[0] >= 0, at[table[0].clamp_min(0).long()], -1)
    return table.to(device)


def torch_fallback(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture, precision, out, out_index):
    """The checks every Triton recurrence makes of its arguments (ValueError on a bad precision,
    out without out_index, or sizes / order that do not match the segments and states), then
    the torch loop's result for what the kernels do not take (float64, or nothing to do), with o
    scattered to `out` when given; None when the Triton kernels should run."""
    if precision not in ("ieee", "tf32x3"):
        raise ValueError(f"kda chunked recurrence: precision must be 'ieee' or 'tf32x3'; got {precision!r}")
    nseg, HV, C, V = U.shape
    K, N = W.shape[-1], initial.shape[0]
    if (out is None) != (out_index is None) or (out is not None and not out.is_contiguous()):
        raise ValueError("kda chunked recurrence: out (contiguous) and out_index go together")
    if any(x.dtype != torch.float32 for x in (W, U, A_qk, qeG, kdec, eGC, initial)) or not (nseg * HV * K * V):
        res = recurrence_torch(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture)   # float64, or nothing to do
        return res if out is None else (_scatter(out, out_index, res[0]), *res[1:])
    if sum(sizes) != nseg or len(order) != N:
        raise ValueError(f"kda chunked recurrence: {nseg} segments and {N} states, but sizes {sizes} sum to "
                         f"{sum(sizes)} over {len(order)} sequences")
    return None


def recurrence(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture=(), block_v=None, num_warps=None,
               slice_=SLICE, precision="ieee", out=None, out_index=None):
    """Phase 2 in one launch: `torch_kernels.kda_chunked_blocked.recurrence_torch`'s signature and
    contract (W, qeG, kdec [nseg, HV, C, K]; U [nseg, HV, C, V]; A_qk [nseg, HV, C, C]; eGC
    [nseg, HV, 1, K]; initial [N, HV, K, V]; the round-major `order`, `sizes`; `capture`, the
    segments whose end states are wanted; returns o_chunks, final states, captured states).

    fp32 tensors (any strides: made contiguous, which phase 1's are already); float64 goes to
    the torch loop, and so do empty inputs (no chunks, heads or state). block_v (a power of two
    >= 16; capped at V's next power of two; default BLOCK_V, or MMA_BLOCK_V for the tensor-core
    form) and num_warps (NUM_WARPS, MMA_NUM_WARPS): launch options for benchmarks.
    precision: the dots' `input_precision`, "ieee" (served: fp32 FMAs, the state in scratch) or
    "tf32x3" (three TF32 tensor-core products, as accurate as fp32 for this chain in
    bench/kda_tf32_sensitivity.py and on the H200's conformance cases; `_recurrence_mma_kernel`,
    the state in registers and whole-depth dots).
    out, out_index: o written straight to the packed rows instead of o_chunks (no scatter after):
    out [rows, HV, V] (contiguous, any float dtype: o rounded to it once), out_index [nseg, C] the
    row of each chunk position (`kda_chunked`'s index; rows >= out.shape[0], the padding, are
    dropped). Returns (out, final states, captured states) then.
    """
    fallback = torch_fallback(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture, precision, out, out_index)
    if fallback is not None:
        return fallback
    nseg, HV, C, V = U.shape
    K, N = W.shape[-1], initial.shape[0]
    mma = precision != "ieee"
    block_v = block_v or (MMA_BLOCK_V if mma else BLOCK_V)
    num_warps = num_warps or (MMA_NUM_WARPS if mma else NUM_WARPS)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"kda chunked recurrence: block_v must be a power of two >= 16; got {block_v}")
    dev = initial.device
    W, U, A_qk, qeG, kdec, eGC, initial = (x.contiguous() for x in (W, U, A_qk, qeG, kdec, eGC, initial))
    rows_out = out is not None
    o_chunks = out if rows_out else torch.empty(nseg, HV, C, V, dtype=torch.float32, device=dev)
    final = torch.empty_like(initial)
    captured = torch.empty(len(capture), HV, K, V, dtype=torch.float32, device=dev)
    table = tables(order, sizes, capture, dev)
    block_v = min(block_v, max(16, triton.next_power_of_2(V)))
    block_c, block_k = max(16, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(K))
    slice_ = min(slice_, block_c, block_k)
    grid = (triton.cdiv(V, block_v), N * HV)
    rows_args = (out_index.long().contiguous(), out.shape[0]) if rows_out else ()   # the O_ROWS kernels' index, rows
    if mma:                                 # tensor-core dots: the state in registers, two halves >= 16
        (_recurrence_mma_rows_kernel if rows_out else _recurrence_mma_kernel)[grid](
            W, U, A_qk, qeG, kdec, eGC, initial, table[0], table[1], o_chunks, final, captured, *rows_args, HV,
            len(sizes), C=C, K=K, V=V, BLOCK_C=block_c, BLOCK_K=max(32, block_k), BLOCK_V=block_v,
            PRECISION=precision, num_warps=num_warps,
        )
        return o_chunks, final, captured
    work = torch.empty(grid[0] * grid[1] * (2 * block_k + block_c) * block_v, dtype=torch.float32, device=dev)
    (_recurrence_rows_kernel if rows_out else _recurrence_kernel)[grid](
        W, U, A_qk, qeG, kdec, eGC, initial, table[0], table[1], o_chunks, final, captured, work, *rows_args, HV,
        len(sizes), C=C, K=K, V=V, BLOCK_C=block_c, BLOCK_K=block_k, BLOCK_V=block_v, SLICE=slice_,
        PRECISION=precision, num_warps=num_warps,
    )
    return o_chunks, final, captured


def _scatter(out, out_index, o_chunks):
    """The torch loop's o_chunks [nseg, HV, C, V] into out's packed rows (what O_ROWS does)."""
    rows = out_index.reshape(-1)
    keep = rows < out.shape[0]
    out[rows[keep]] = o_chunks.permute(0, 2, 1, 3).reshape(-1, *out.shape[1:])[keep].to(out.dtype)
    return out
