"""Phase 2 of the batched chunked KDA prefill (`torch_kernels/kda_chunked_blocked.py`), the state
recurrence across chunks, split in two launches so the output product leaves the serial chain:
`recurrence_split`, with `kda_chunked_recurrence.recurrence`'s signature and contract.

The fused kernel (`kda_chunked_recurrence._recurrence_mma_rows_kernel`) does four dots a chunk in
the chain that carries the state (W_c @ S, qeG_c @ S, A_qk_c @ delta, kdec_c^T @ delta) at 255
registers (264 B spilled at 32 columns and 4 warps), so 2 of its 384 programs fit an SM and they
run in two rounds (4.21 ms at 8K tokens x 96 heads on an H100). Only two of the four products
feed the next state; the output is a function of the chunk's starting state and delta alone:

1. `_state_kernel`, one program per (BLOCK_V columns of the state, sequence x value head), as
   the fused kernel: it walks the sequence's chunks with its [K, BLOCK_V] slice of the fp32 state
   S in registers (two halves of K rows), per chunk c

       store S_c = S                                 [K, BLOCK_V]  -> states [nseg, HV, K, V]
       delta = U_c[:, cols] - W_c @ S                [C, BLOCK_V]  -> deltas [nseg, HV, C, V]
       S = eGC_c[:, None] * S + kdec_c^T @ delta     [K, BLOCK_V]

   storing S to the chunk's checkpoint slot when its end is wanted, and the final S (the initial
   state read, the checkpoints and the final state written exactly as `recurrence` does). Two
   dots a step (each three TF32 products in "tf32x3"), nothing but S held across steps.
   The chunk loop is a for loop over the [N, R] segment table's R columns (a past-the-end entry,
   -1, turns every load and store of its step off: its delta is 0 and its decay 1, so S goes
   through unchanged), software-pipelined by Triton (`tl.range(num_stages=)`): the next chunk's
   W, kdec, U tiles are fetched while this one's dots run. Compiled (not under the interpreter),
   the loop stops at the sequence's own chunk count (an [N] int32 tensor beside the tables)
   instead of R (the interpreter takes no loaded value as a loop bound; the masked steps make
   both the same).
2. `_output_kernel`, fully parallel, one program per ((segment, head), BLOCK_V output columns)
   on a 1-D grid (the V blocks of a (segment, head) adjacent, so its qeG and A_qk tiles are read
   from DRAM once):

       o_c[:, cols] = qeG_c @ S_c[:, cols] + A_qk_c @ delta_c[:, cols]     [C, BLOCK_V]

   stored to o_chunks, or with O_ROWS straight to the packed token rows through the chunk index
   in o's dtype (`kda_chunked_recurrence._store_o`, as the fused O_ROWS kernels do).

Precision: every dot takes `precision` ("tf32x3", three TF32 tensor-core products per dot, as
accurate as fp32 for this chain in bench/kda_tf32_sensitivity.py, where plain TF32 or bf16 are
not; or "ieee", fp32 FMAs); S_c and delta_c are kept and stored in fp32. "ieee" runs the same
kernels: correct, but Triton's fp32 FMA dots hold their whole depth per thread, so the state
kernel spills there (the fused `recurrence`'s scratch form is the fast exact one).

Bytes at 8K tokens, 96 heads, K = V = 128, C = 64 (nseg = 128 chunks; fp32; MB = 1e6 B): the
state kernel reads W, kdec, U (403 MB each; a head's column blocks are neighbours in the grid, so
they share its W and kdec tiles through L2) and eGC (6 MB) and writes the states (805 MB) and
deltas (403 MB): 2.4 GB; the output kernel reads qeG (403 MB), A_qk (201 MB), the states
(805 MB), the deltas (403 MB) and writes o (201 MB in bf16): 2.0 GB; 4.4 GB in all (about 1.5 ms
at an H100's ~3 TB/s) against the fused kernel's 2.0 GB. The split trades bytes for a serial
chain of two dots a chunk and a grid that fits one wave; its working buffers (the states and
deltas: 1.2 GB here, 96 KiB a chunk and head) are allocated per call.
bench/ptxas_report.py compiles the launched tiles for sm_90a.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreted
from .kda_chunked_recurrence import SLICE, _store_o, tables, torch_fallback

# The state kernel's launch (ptxas, sm_90a, K3's shapes, tf32x3): 64 columns, 4 warps, the next
# chunk's tiles fetched one step ahead: 255 registers, 16 B spilled, 112.5 KiB of shared memory,
# so 2 programs an SM and its 192 programs (96 heads x 2 column blocks at 8K) in one wave of the
# H100's 132 SMs. 32 columns: 235 registers (no spills) and 88.5 KiB, 2 an SM, so its 384
# programs take two rounds; without the prefetch (num_stages=1) and held to 168 registers
# (max_registers=168: 84 B spilled, 16 KiB) 3 fit an SM, one wave, each step waiting on its loads
STATE_BLOCK_V = 64
STATE_NUM_WARPS = 4
STATE_NUM_STAGES = 2          # the chunk loop's software pipeline depth (2: the next chunk's tiles fetched ahead)
OUT_BLOCK_V = 64              # the output kernel's columns a program (4 warps, o to bf16 rows: 186 registers, no spills)
OUT_NUM_WARPS = 4
OUT_K_SLICE = 64              # the depth of its qeG @ S_c dots (K walked in slices of it)


@triton.jit
def _state_kernel(
    w_ptr, u_ptr, kdec_ptr, egc_ptr, h0_ptr, seg_ptr, slot_ptr, cnt_ptr, st_ptr, d_ptr, ht_ptr, ckpt_ptr, HV, R,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, STEPS: tl.constexpr,
):
    # all tensors contiguous: W, kdec [nseg, HV, C, K]; U [nseg, HV, C, V]; eGC [nseg, HV, 1, K];
    # h0, ht [N, HV, K, V]; ckpt [slots, HV, K, V]; seg, slot [N, R] int32 (-1 past a sequence's
    # chunks / where no checkpoint), cnt [N] int32 (each sequence's chunks); out: the states
    # st [nseg, HV, K, V] (each chunk's starting state) and the deltas d [nseg, HV, C, V].
    # The state lives in registers as two halves of K rows (S1, S2: [HALF, BLOCK_V]), so each
    # dot's operands, split three ways by 3xTF32, fit (as in the fused tensor-core kernel)
    HALF: tl.constexpr = BLOCK_K // 2
    nh = tl.program_id(1).to(tl.int64)
    n = nh // HV
    h = nh % HV
    cc = tl.arange(0, BLOCK_C)                                              # chunk rows
    k1 = tl.arange(0, HALF)
    k2 = HALF + k1
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)                 # the state's columns
    c_in, v_in, k1_in, k2_in = cc < C, vv < V, k1 < K, k2 < K
    cv_in = c_in[:, None] & v_in[None, :]
    kv1_in = k1_in[:, None] & v_in[None, :]
    kv2_in = k2_in[:, None] & v_in[None, :]
    ck1_in = c_in[:, None] & k1_in[None, :]                                 # [BLOCK_C, HALF]
    ck2_in = c_in[:, None] & k2_in[None, :]
    kc1_in = k1_in[:, None] & c_in[None, :]                                 # [HALF, BLOCK_C]
    kc2_in = k2_in[:, None] & c_in[None, :]
    kv1 = k1[:, None] * V + vv[None, :]                                     # [HALF, BLOCK_V] offsets in a state
    kv2 = k2[:, None] * V + vv[None, :]
    cv = cc[:, None] * V + vv[None, :]                                      # [BLOCK_C, BLOCK_V] in a U / delta tile
    S1 = tl.load(h0_ptr + nh * K * V + kv1, mask=kv1_in, other=0.0)        # [HALF, BLOCK_V]
    S2 = tl.load(h0_ptr + nh * K * V + kv2, mask=kv2_in, other=0.0)
    # compiled (STEPS 0): the sequence's own chunk count as the loop bound; the interpreter takes
    # no runtime bound, so there it walks all R (= STEPS) columns, those past the end masked off
    for r in tl.range(0, STEPS if STEPS > 0 else tl.load(cnt_ptr + n), num_stages=NUM_STAGES):
        seg = tl.load(seg_ptr + n * R + r).to(tl.int64)                    # -1 past the sequence's chunks
        on = seg >= 0
        sh = tl.maximum(seg, 0) * HV + h                                    # the chunk's (segment, head)
        tl.store(st_ptr + sh * K * V + kv1, S1, mask=kv1_in & on)          # the chunk's starting state
        tl.store(st_ptr + sh * K * V + kv2, S2, mask=kv2_in & on)
        base_ck = sh * C * K + cc[:, None] * K
        delta = tl.load(u_ptr + sh * C * V + cv, mask=cv_in & on, other=0.0)
        delta -= tl.dot(tl.load(w_ptr + base_ck + k1[None, :], mask=ck1_in & on, other=0.0), S1,
                        input_precision=PRECISION)
        delta -= tl.dot(tl.load(w_ptr + base_ck + k2[None, :], mask=ck2_in & on, other=0.0), S2,
                        input_precision=PRECISION)
        tl.store(d_ptr + sh * C * V + cv, delta, mask=cv_in & on)
        # e^(G_C) per key row: 0 on padded rows (S stays 0 there), 1 past the end (S goes through)
        d1 = tl.where(on, tl.load(egc_ptr + sh * K + k1, mask=k1_in & on, other=0.0), 1.0)
        d2 = tl.where(on, tl.load(egc_ptr + sh * K + k2, mask=k2_in & on, other=0.0), 1.0)
        KT1 = tl.load(kdec_ptr + sh * C * K + cc[None, :] * K + k1[:, None], mask=kc1_in & on,
                      other=0.0)                                            # [HALF, BLOCK_C]
        KT2 = tl.load(kdec_ptr + sh * C * K + cc[None, :] * K + k2[:, None], mask=kc2_in & on, other=0.0)
        S1 = tl.dot(KT1, delta, acc=d1[:, None] * S1, input_precision=PRECISION)
        S2 = tl.dot(KT2, delta, acc=d2[:, None] * S2, input_precision=PRECISION)
        slot = tl.load(slot_ptr + n * R + r).to(tl.int64)                  # -1 past the end, or no checkpoint
        dst = ckpt_ptr + (tl.maximum(slot, 0) * HV + h) * K * V
        tl.store(dst + kv1, S1, mask=kv1_in & (slot >= 0))
        tl.store(dst + kv2, S2, mask=kv2_in & (slot >= 0))
    tl.store(ht_ptr + nh * K * V + kv1, S1, mask=kv1_in)
    tl.store(ht_ptr + nh * K * V + kv2, S2, mask=kv2_in)


@triton.jit
def _output_body(
    a_ptr, qeg_ptr, st_ptr, d_ptr, o_ptr, idx_ptr, n_out, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, K_SLICE: tl.constexpr,
    PRECISION: tl.constexpr, O_ROWS: tl.constexpr,
):
    # qeG [nseg, HV, C, K]; A [nseg, HV, C, C]; the state kernel's st [nseg, HV, K, V] and
    # d [nseg, HV, C, V]; o: o_chunks [nseg, HV, C, V], or with O_ROWS the rows [n_out, HV, V]
    # through idx [nseg, C] (`_store_o`). The qeG @ S_c product walks K in slices of K_SLICE.
    # A 1-D grid, the V blocks of one (segment, head) adjacent: they read its qeG and A tiles
    # while those are still in L2 (and nseg * HV exceeds a second grid axis' 65,535 past 43K tokens)
    NVB: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    pid = tl.program_id(0).to(tl.int64)
    sh = pid // NVB                                                         # (segment, head)
    seg = sh // HV
    h = sh % HV
    cc = tl.arange(0, BLOCK_C)
    ks = tl.arange(0, K_SLICE)
    vv = (pid % NVB) * BLOCK_V + tl.arange(0, BLOCK_V)
    c_in, v_in = cc < C, vv < V
    cv_in = c_in[:, None] & v_in[None, :]
    D = tl.load(d_ptr + sh * C * V + cc[:, None] * V + vv[None, :], mask=cv_in, other=0.0)   # [BLOCK_C, BLOCK_V]
    A = tl.load(a_ptr + sh * C * C + cc[:, None] * C + cc[None, :], mask=c_in[:, None] & c_in[None, :],
                other=0.0)                                                  # [BLOCK_C, BLOCK_C]
    o = tl.dot(A, D, input_precision=PRECISION)
    for k0 in tl.static_range(0, BLOCK_K, K_SLICE):                        # o += qeG S_c
        kk = k0 + ks
        k_in = kk < K
        Q = tl.load(qeg_ptr + sh * C * K + cc[:, None] * K + kk[None, :], mask=c_in[:, None] & k_in[None, :],
                    other=0.0)                                              # [BLOCK_C, K_SLICE]
        S = tl.load(st_ptr + sh * K * V + kk[:, None] * V + vv[None, :], mask=k_in[:, None] & v_in[None, :],
                    other=0.0)                                              # [K_SLICE, BLOCK_V]
        o = tl.dot(Q, S, acc=o, input_precision=PRECISION)
    _store_o(o_ptr, idx_ptr, o, seg, sh, h, HV, n_out, cc, vv, c_in, v_in, C, V, O_ROWS)


@triton.jit
def _output_kernel(
    a_ptr, qeg_ptr, st_ptr, d_ptr, o_ptr, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, K_SLICE: tl.constexpr, PRECISION: tl.constexpr,
):
    _output_body(a_ptr, qeg_ptr, st_ptr, d_ptr, o_ptr, o_ptr, 0, HV, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V, K_SLICE,
                 PRECISION, False)


@triton.jit
def _output_rows_kernel(
    a_ptr, qeg_ptr, st_ptr, d_ptr, o_ptr, idx_ptr, n_out, HV,
    C: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, K_SLICE: tl.constexpr, PRECISION: tl.constexpr,
):
    _output_body(a_ptr, qeg_ptr, st_ptr, d_ptr, o_ptr, idx_ptr, n_out, HV, C, K, V, BLOCK_C, BLOCK_K, BLOCK_V,
                 K_SLICE, PRECISION, True)


def recurrence_split(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture=(), block_v=None, num_warps=None,
                     slice_=SLICE, precision="ieee", out=None, out_index=None, num_stages=None, max_registers=None,
                     out_block_v=None, out_num_warps=None, out_k_slice=None):
    """Phase 2 in two launches (the state kernel, then the output kernel): `recurrence`'s
    signature, contract and return (W, qeG, kdec [nseg, HV, C, K]; U [nseg, HV, C, V]; A_qk
    [nseg, HV, C, C]; eGC [nseg, HV, 1, K]; initial [N, HV, K, V]; the round-major `order`,
    `sizes`; `capture`, the segments whose end states are wanted; returns o_chunks, final
    states, captured states, or with out / out_index (o straight to the packed rows in out's
    dtype, `recurrence`'s) out, final states, captured states).

    fp32 tensors (made contiguous); float64 and empty inputs go to the torch loop. precision:
    every dot's `input_precision`, "tf32x3" (the form this is built for) or "ieee" (same kernels,
    fp32 FMAs; spills on a GPU, see the module docstring). Launch options for benchmarks:
    block_v, num_warps, num_stages, max_registers: the state kernel's columns a program (a power
    of two >= 16, capped at V's next power of two; default STATE_BLOCK_V), warps
    (STATE_NUM_WARPS), chunk pipeline depth (STATE_NUM_STAGES) and register cap (Triton's
    maxnreg; None: ptxas's choice); out_block_v, out_num_warps: the output kernel's
    (OUT_BLOCK_V, OUT_NUM_WARPS) and the depth of its qeG @ S_c dots (out_k_slice, a power of
    two >= 16, capped at K's padded size; default OUT_K_SLICE). slice_: taken for `recurrence`'s
    signature (its scratch form's dot depth), unused here.
    """
    fallback = torch_fallback(W, U, A_qk, qeG, kdec, eGC, initial, order, sizes, capture, precision, out, out_index)
    if fallback is not None:
        return fallback
    nseg, HV, C, V = U.shape
    K, N = W.shape[-1], initial.shape[0]
    block_v, out_block_v, k_slice = block_v or STATE_BLOCK_V, out_block_v or OUT_BLOCK_V, out_k_slice or OUT_K_SLICE
    for name, b in (("block_v", block_v), ("out_block_v", out_block_v), ("out_k_slice", k_slice)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"kda chunked recurrence: {name} must be a power of two >= 16; got {b}")
    dev = initial.device
    W, U, A_qk, qeG, kdec, eGC, initial = (x.contiguous() for x in (W, U, A_qk, qeG, kdec, eGC, initial))
    rows_out = out is not None
    o_chunks = out if rows_out else torch.empty(nseg, HV, C, V, dtype=torch.float32, device=dev)
    final = torch.empty_like(initial)
    captured = torch.empty(len(capture), HV, K, V, dtype=torch.float32, device=dev)
    states = torch.empty(nseg, HV, K, V, dtype=torch.float32, device=dev)     # each chunk's starting state
    deltas = torch.empty(nseg, HV, C, V, dtype=torch.float32, device=dev)
    table = tables(order, sizes, capture, dev)
    counts = (table[0] >= 0).sum(1, dtype=torch.int32)                       # [N] each sequence's chunks
    vp = max(16, triton.next_power_of_2(V))
    block_c, block_k = max(16, triton.next_power_of_2(C)), max(32, triton.next_power_of_2(K))
    block_v, out_block_v = min(block_v, vp), min(out_block_v, vp)
    _state_kernel[(triton.cdiv(V, block_v), N * HV)](
        W, U, kdec, eGC, initial, table[0], table[1], counts, states, deltas, final, captured, HV, len(sizes),
        C=C, K=K, V=V, BLOCK_C=block_c, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision,
        NUM_STAGES=num_stages or STATE_NUM_STAGES, STEPS=len(sizes) if interpreted() else 0,
        num_warps=num_warps or STATE_NUM_WARPS, **({"maxnreg": max_registers} if max_registers else {}),
    )
    k_slice = min(k_slice, block_k)
    grid = (nseg * HV * triton.cdiv(V, out_block_v),)
    rows_args = (out_index.long().contiguous(), out.shape[0]) if rows_out else ()   # the O_ROWS kernel's index, rows
    (_output_rows_kernel if rows_out else _output_kernel)[grid](
        A_qk, qeG, states, deltas, o_chunks, *rows_args, HV, C=C, K=K, V=V, BLOCK_C=block_c, BLOCK_K=block_k,
        BLOCK_V=out_block_v, K_SLICE=k_slice, PRECISION=precision, num_warps=out_num_warps or OUT_NUM_WARPS,
    )
    return o_chunks, final, captured
