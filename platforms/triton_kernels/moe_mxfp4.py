"""Routed experts over MXFP4 weights in Triton (W4A16, dequantised inside the kernel):
`MoEKernels.experts` (see k3.reference.experts_forward for the contract).

Two launches, grouped by expert so each weight tile is read once per BLOCK_T tokens routed to
that expert (not once per token), with the weights as the matrix product's M operand ("swap
AB": an expert's BLOCK_N weight rows times its BLOCK_T tokens), so a decode step with one token
per expert still fills the tensor cores' 64-row side with weights rather than padding:
  1. gate/up: program (token tile, I block) gathers the BLOCK_T rows of x routed to its tile's
     expert, multiplies its gate rows and up rows of w13 by them and applies SiTU-GLU
     (or SiLU-GLU) in fp32, writing one row of activations per (token, choice);
  2. down: program (token tile, L block) multiplies those rows by the
     expert's w2 and scales them by the routing weight, one fp32 row per (token, choice);
then the k rows of each token are summed in torch (a fixed order: no atomics, so the result is
the same at every batch composition). Tokens are grouped by a device-side argsort of the
expert ids and cut into tiles of BLOCK_T (token, choice) pairs of one expert (`expert_tiles`: an
expert's tiles are neighbours on the grid's first axis, so they share its weight tiles in L2;
a prefill of 8K tokens runs ~T*k/BLOCK_T busy tiles rather than a T/BLOCK_T-deep block per expert,
most of them empty): no host synchronisation, so decode steps can be
captured in a CUDA graph, and `dense_dispatch` (the reference's host-sync-free mode) changes
nothing here but keeps batches off the "dequant" mode, which reads the expert counts on the host.

Four ways to multiply (the `mode` launch option):
  - "gemv" (bf16 batches of up to GEMV_MAX_TOKENS tokens on a GPU, the default there; any
    activation dtype): moe_mxfp4_gemv.py, one program per (token, choice) and 32 weight rows (4 a
    thread) on the CUDA cores, for decode steps where an expert sees a token or two; products
    summed in fp32 (its fp16x2 form, `half=True`, sums a group's products in fp16: issue 32);
  - "gemv_grouped" (bf16 activations, experimental): moe_mxfp4_gemv_grouped.py, the gemv's fp16x2
    products with each weight tile loaded and decoded once for up to `group_tokens` pairs of its
    expert (pairs grouped by expert on the device, as below); equal bit for bit to the fp16x2 gemv
    as served before issue 32, so it does not round where the other modes do;
  - "dot_scaled" (bf16 activations on a GPU, the default there above GEMV_MAX_TOKENS): `tl.dot_scaled` with the E2M1
    codes and E8M0 scales as they are stored; Triton upcasts them to bf16 in registers (exact:
    every MXFP4 value is a bf16) and multiplies on the tensor cores with fp32 accumulation;
    the gate/up activations are stored in bf16 (as the reference rounds them in a bf16 model);
  - "dequant" (bf16 activations on a GPU, the default there from DEQUANT_MIN_TOKENS tokens: prefill
    chunks): moe_mxfp4_dequant.py, the active experts dequantised to bf16 once, a group at a time
    (one launch a group), and multiplied as grouped products (torch._grouped_mm where it runs),
    one host synchronisation;
  - "decode" (fp32 and fp16 activations, and the Triton interpreter, which has no dot_scaled):
    the kernel decodes each nibble itself (an E2M1 code placed as an fp16's sign, two lowest
    exponent bits and top mantissa bit is its value / 2^14), scales each 32-element group, and multiplies
    the even columns of x by the low nibbles and the odd columns by the high ones (MXFP4 packs
    element 2j in the low nibble of byte j); IEEE products for fp32 models, tf32 for fp16 (which
    holds fp16 activations and every MXFP4 weight exactly); activations kept in fp32;
  - "decode_bf16" (bf16 activations; nvidia's promoted `moe_experts_bf16` for 16-1,023 tokens,
    issue 27): the same tiles, each nibble placed by PTX bit operations as a bf16's sign, two
    lowest exponent bits and top mantissa bit (its value / 2^126) and scaled by power-of-two bf16
    multiplies (exact; one instead of two where every scale code is <= 128, `folding_safe`), then
    bf16 tensor-core products with fp32 accumulation, in the registers without dot_scaled's
    upcast; gate/up activations stored in bf16 as for dot_scaled. Under the interpreter (no PTX)
    the fp32 decode rounded to bf16.

The tensor-core modes' loads (issue 27): Triton's software pipeline issues a step's code bytes
ahead as cp.async, but not loads under 4 bytes a thread, which stay in the loop as a round trip
to memory every step; so each step's E8M0 scale bytes are loaded one step ahead by hand, and the
activation columns as contiguous rows (pipelined) split into even / odd columns in the registers
(`pipelined_loads`; the H100 measured 1.11-1.14x on decode_bf16, 1.02-1.08x on dot_scaled). Experts
repacked tile-major (`k3.quant.mxfp4_tiles.TileMajorMXFP4`, 4 KB of codes a step, contiguous) are
read as such by every mode but gemv_grouped; they stream near the copy bandwidth where 128 rows x
32 bytes a step from 1,792-byte rows reach 62% of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.platforms.torch_kernels import moe_experts as torch_experts
from k3.quant.mxfp4 import MXFP4Tensor

from . import interpreted, moe_mxfp4_dequant, moe_mxfp4_gemv, moe_mxfp4_gemv_grouped, moe_mxfp4_layout, rounding
from .rounding import round_to
from .moe_mxfp4_common import e2m1_bf16_pairs, e2m1_over_16384, e8m0_multiplier, expert_tile_grid
from .moe_mxfp4_common import gated_activation, tile_major_row
from .moe_mxfp4_common import expert_tiles  # noqa: F401  (k3.platforms.triton_kernels.moe_mxfp4.expert_tiles)

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("dot_scaled", "decode", "decode_bf16", "gemv", "gemv_grouped", "dequant")
# the tiled layout (moe_mxfp4_layout.py); used as `.value` (plain ints: the interpreter cannot take an int
# modulo a constexpr, and k0 is an int at the loops' first step)
_TILE_ROWS = tl.constexpr(moe_mxfp4_layout.TILE_ROWS)
_TILE_COLS = tl.constexpr(moe_mxfp4_layout.TILE_COLS)


@triton.jit
def _scale_codes(scales_ptr, rows, mask_r, k0, s_sr, G: tl.constexpr, TILED: tl.constexpr = False):
    """E8M0 scale codes [R, G] (int32) of groups k0/32 .. k0/32+G-1 of weight rows `rows` (from
    an expert's scales, `_weight_rows`; s_sr: a row's stride), a byte each (Triton issues such loads where they stand, no
    cp.async under 4 bytes, so the kernels load a step's codes a step ahead when SCALES_AHEAD).
    TILED: rows within one row tile of moe_mxfp4_layout's tiles (`_weight_rows`), the step's
    groups within one column tile (its 256-byte block, then group % 2)."""
    if TILED:
        per_tile: tl.constexpr = _TILE_COLS.value // 32
        tile, start = (k0 // _TILE_COLS.value) * (_TILE_ROWS.value * per_tile), (k0 % _TILE_COLS.value) // 32
    else:
        tile, start = 0, k0 // 32
    return tl.load(scales_ptr + tile + rows[:, None] * s_sr + (start + tl.arange(0, G))[None, :],
                   mask=mask_r[:, None], other=127).to(tl.int32)                      # [R, G]


@triton.jit
def _step_start(k0, TILED: tl.constexpr):
    """Where column k0's code byte lies from its weight row's first byte, as (offset of its column
    tile, byte within): the checkpoint layout's (0, k0 / 2); TILED (rows within one row tile of
    moe_mxfp4_layout's tiles, `_weight_rows`; a step's columns within one column tile) the tile's
    4 KB block, then k0 % 64 / 2, so the loads keep the checkpoint layout's shape."""
    if TILED:
        half_cols: tl.constexpr = _TILE_COLS.value // 2
        return (k0 // _TILE_COLS.value) * (_TILE_ROWS.value * half_cols), tl.multiple_of((k0 % _TILE_COLS.value) // 2, 16)
    return 0, k0 // 2


@triton.jit
def _row_codes(packed_ptr, rows, mask_r, k0, s_pr, BLOCK_K: tl.constexpr, TILED: tl.constexpr = False):
    """Packed codes of columns k0..k0+BLOCK_K of weight rows `rows` (from an expert's codes,
    `_weight_rows`; s_pr: a row's stride; TILED: `_step_start`): [R, BLOCK_K/32, 16] uint8."""
    G: tl.constexpr = BLOCK_K // 32
    tile, start = _step_start(k0, TILED)
    byte = (start + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :])              # [G, 16]
    return tl.load(packed_ptr + tile + rows[:, None, None] * s_pr + byte[None, :, :],
                   mask=mask_r[:, None, None], other=0)                                 # [R, G, 16]


@triton.jit
def _weight_rows(packed_ptr, scales_ptr, e, row0, BLOCK_N: tl.constexpr, K: tl.constexpr, s_pe, s_pr, s_se, s_sr,
                 TILED: tl.constexpr):
    """Rows row0 .. row0+BLOCK_N of expert e (K columns) as the loaders above take them: (codes
    pointer, scales pointer, row indices [BLOCK_N]), with the row strides s_pr and s_sr. The
    checkpoint layout: the expert's pointers and the rows themselves. TILED
    (moe_mxfp4_layout's tiles; s_pr, s_sr: a row's stride within a tile, 32 and 2, passed at run
    time like the checkpoint layout's strides, so Triton lays the loads out alike; BLOCK_N divides
    128 and row0 is a multiple of it): the pointers of row0 within its row tile, rows 0..BLOCK_N-1
    from there."""
    if TILED:
        first = tile_major_row(row0, K)
        return packed_ptr + e * s_pe + first * s_pr, scales_ptr + e * s_se + first * s_sr, tl.arange(0, BLOCK_N)
    return packed_ptr + e * s_pe, scales_ptr + e * s_se, row0 + tl.arange(0, BLOCK_N)


@triton.jit
def _decoded_rows(packed_ptr, sc, rows, mask_r, k0, s_pr, BLOCK_K: tl.constexpr, TILED: tl.constexpr = False):
    """Columns k0..k0+BLOCK_K of weight rows `rows` (`_row_codes`; sc: their scale codes, from
    `_scale_codes`), dequantised in fp32: ([R, BLOCK_K/2] even columns (low nibbles),
    [R, BLOCK_K/2] odd columns (high nibbles))."""
    packed = _row_codes(packed_ptr, rows, mask_r, k0, s_pr, BLOCK_K, TILED).to(tl.int32)
    mult = e8m0_multiplier(sc)[:, :, None]
    lo = (e2m1_over_16384(packed & 15) * 16384.0) * mult                               # exact, then scaled
    hi = (e2m1_over_16384(packed >> 4) * 16384.0) * mult
    return tl.reshape(lo, (lo.shape[0], BLOCK_K // 2)), tl.reshape(hi, (hi.shape[0], BLOCK_K // 2))


@triton.jit
def _decoded_rows_bf16(packed_ptr, sc, rows, mask_r, k0, s_pr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                       FOLD: tl.constexpr = False, TILED: tl.constexpr = False):
    """`_decoded_rows` as bf16, exact (every MXFP4 value is a bf16; products past bf16's range
    are inf, as in fp32): ASM, the PTX of `e2m1_bf16_pairs` (NVIDIA GPUs; FOLD: its folded form,
    for scale codes up to 128 only); else `_decoded_rows` rounded to bf16 (the interpreter, whose
    bf16 arithmetic is not IEEE)."""
    if ASM:
        lo, hi = e2m1_bf16_pairs(_row_codes(packed_ptr, rows, mask_r, k0, s_pr, BLOCK_K, TILED), sc, FOLD)
        return tl.reshape(lo, (lo.shape[0], BLOCK_K // 2)), tl.reshape(hi, (hi.shape[0], BLOCK_K // 2))
    lo, hi = _decoded_rows(packed_ptr, sc, rows, mask_r, k0, s_pr, BLOCK_K, TILED)
    return lo.to(tl.bfloat16), hi.to(tl.bfloat16)


@triton.jit
def _token_columns(src_ptr, src_row, s_src, mask_t, k0, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                   PIPELINED: tl.constexpr):
    """Columns k0..k0+BLOCK_K of the activation rows `src_row` (one a token) as the products
    take them: MODE 0, bf16 [BLOCK_K, T] (twice); else (even columns, odd columns) [BLOCK_K/2, T].
    PIPELINED: the even and odd columns split in the registers from one contiguous load a row,
    which the software pipeline issues ahead as cp.async; else two loads two bytes apart, which
    it leaves in the loop (a round trip to L2 every step)."""
    if MODE == 0:
        x_a = tl.load(src_ptr + src_row[None, :] * s_src + (k0 + tl.arange(0, BLOCK_K))[:, None],
                      mask=mask_t[None, :], other=0.0).to(tl.bfloat16)
        x_b = x_a
    elif PIPELINED:
        xk = tl.load(src_ptr + src_row[:, None] * s_src + (k0 + tl.arange(0, BLOCK_K))[None, :],
                     mask=mask_t[:, None], other=0.0)                                  # [T, BLOCK_K]
        x_even, x_odd = tl.split(tl.reshape(xk, (xk.shape[0], BLOCK_K // 2, 2)))
        x_a, x_b = tl.trans(x_even), tl.trans(x_odd)
    else:
        half = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        x_a = tl.load(src_ptr + src_row[None, :] * s_src + half[:, None], mask=mask_t[None, :], other=0.0)
        x_b = tl.load(src_ptr + src_row[None, :] * s_src + (half + 1)[:, None], mask=mask_t[None, :], other=0.0)
    return x_a, x_b


@triton.jit
def _rows_times_tokens(packed_ptr, sc, rows, mask_r, x_a, x_b, k0, acc, s_pr, BLOCK_K: tl.constexpr,
                       MODE: tl.constexpr, IEEE: tl.constexpr, TILED: tl.constexpr):
    """acc [R, T] += W[rows, k0:k0+BLOCK_K] @ (token columns k0:k0+BLOCK_K)^T (W: an expert's
    codes, `_weight_rows`): sc, the rows' scale codes of these columns (`_scale_codes`); x_a, x_b, the columns as `_token_columns`
    returns them. MODE 0: dot_scaled on the stored codes, 1: decoded in the kernel to fp32,
    2 / 3 / 4: decoded in the kernel to bf16 for bf16 tensor-core products, by fp32 bit placement
    / by PTX on bf16 pairs / by PTX with the bias folded into the scale, for scale codes <= 128.
    TILED: the codes in moe_mxfp4_layout's tile-major layout."""
    if MODE == 0:
        tile, start = _step_start(k0, TILED)
        packed = tl.load(packed_ptr + tile + rows[:, None] * s_pr + (start + tl.arange(0, BLOCK_K // 2))[None, :],
                         mask=mask_r[:, None], other=0)                                # [R, BLOCK_K/2] u8
        acc = tl.dot_scaled(packed, sc.to(tl.uint8), "e2m1", x_a, None, "bf16", acc)
    elif MODE >= 2:
        lo, hi = _decoded_rows_bf16(packed_ptr, sc, rows, mask_r, k0, s_pr, BLOCK_K, MODE >= 3, MODE == 4, TILED)
        acc = tl.dot(lo, x_a.to(tl.bfloat16), acc)                                   # bf16 operands, fp32 sums
        acc = tl.dot(hi, x_b.to(tl.bfloat16), acc)
    else:
        lo, hi = _decoded_rows(packed_ptr, sc, rows, mask_r, k0, s_pr, BLOCK_K, TILED)
        x_even, x_odd = x_a.to(tl.float32), x_b.to(tl.float32)                        # [BLOCK_K/2, T]
        if IEEE:
            acc += tl.dot(lo, x_even, input_precision="ieee") + tl.dot(hi, x_odd, input_precision="ieee")
        else:
            acc += tl.dot(lo, x_even, input_precision="tf32") + tl.dot(hi, x_odd, input_precision="tf32")
    return acc


@triton.jit
def _routed_choices(tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr, BLOCK_T: tl.constexpr):
    """This program's tile (program_id(0)): its expert e (int64), its (token, choice) indices
    (int64), their mask, and whether the tile has any (tiles past the last hold expert E_local,
    whose count is 0)."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)   # e * expert stride can pass 2^31 (k3-slice: 1.4e9)
    t0 = tl.load(tile_start_ptr + tile)
    count = tl.load(count_ptr + e)
    slot = t0 + tl.arange(0, BLOCK_T)
    mask_t = slot < count
    choice = tl.load(order_ptr + tl.load(start_ptr + e) + slot, mask=mask_t, other=0).to(tl.int64)
    return e, choice, mask_t, t0 < count


@triton.jit
def _gate_up_kernel(
    x_ptr, p13_ptr, s13_ptr, tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr, act_ptr, delta_ptr,
    s_x, s_pe, s_pr, s_se, s_sr, s_act, s_delta,
    TOPK, beta, linear_beta,
    L: tl.constexpr, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, MODE: tl.constexpr,
    IEEE: tl.constexpr, ROUND_ACT: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, HAS_DELTA: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPELINED: tl.constexpr,
    SCALES_AHEAD: tl.constexpr, TILED: tl.constexpr,
):
    e, choice, mask_t, busy = _routed_choices(tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr,
                                              BLOCK_T)
    if not busy:
        return
    token = choice // TOPK
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = col < I
    acc_g = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    G: tl.constexpr = BLOCK_K // 32
    # this program's gate rows and up rows (I further on): codes and scales pointers, row indices and strides
    p_g, s_g, r_g = _weight_rows(p13_ptr, s13_ptr, e, tl.program_id(1) * BLOCK_N, BLOCK_N, L, s_pe, s_pr, s_se, s_sr,
                                 TILED)
    p_u, s_u, r_u = _weight_rows(p13_ptr, s13_ptr, e, I + tl.program_id(1) * BLOCK_N, BLOCK_N, L, s_pe, s_pr, s_se,
                                 s_sr, TILED)
    sc_g = _scale_codes(s_g, r_g, mask_n, 0, s_sr, G, TILED)
    sc_u = _scale_codes(s_u, r_u, mask_n, 0, s_sr, G, TILED)
    for k0 in range(0, L, BLOCK_K):
        if SCALES_AHEAD:    # the next step's scale codes (the last step reloads the first's: in bounds, unused)
            k_next = (k0 + BLOCK_K) % L
            sc_g_next = _scale_codes(s_g, r_g, mask_n, k_next, s_sr, G, TILED)
            sc_u_next = _scale_codes(s_u, r_u, mask_n, k_next, s_sr, G, TILED)
        else:
            sc_g = _scale_codes(s_g, r_g, mask_n, k0, s_sr, G, TILED)
            sc_u = _scale_codes(s_u, r_u, mask_n, k0, s_sr, G, TILED)
            sc_g_next, sc_u_next = sc_g, sc_u
        x_a, x_b = _token_columns(x_ptr, token, s_x, mask_t, k0, BLOCK_K, MODE, PIPELINED)   # one load for both
        acc_g = _rows_times_tokens(p_g, sc_g, r_g, mask_n, x_a, x_b, k0, acc_g, s_pr, BLOCK_K, MODE, IEEE, TILED)
        acc_u = _rows_times_tokens(p_u, sc_u, r_u, mask_n, x_a, x_b, k0, acc_u, s_pr, BLOCK_K, MODE, IEEE, TILED)
        sc_g, sc_u = sc_g_next, sc_u_next
    if HAS_DELTA:       # a LoRA adapter's gate / up rows of each (token, choice), before the activation
        both = mask_t[None, :] & mask_n[:, None]
        acc_g += tl.load(delta_ptr + choice[None, :] * s_delta + col[:, None], mask=both, other=0.0)
        acc_u += tl.load(delta_ptr + choice[None, :] * s_delta + (I + col)[:, None], mask=both, other=0.0)
    acc_g, acc_u = round_to(acc_g, ROUND_PRODUCTS), round_to(acc_u, ROUND_PRODUCTS)    # the gate/up products
    out = round_to(gated_activation(acc_g, acc_u, beta, linear_beta, SITU, HAS_LINEAR_BETA), ROUND_ACT)  # [BLOCK_N, BLOCK_T]
    tl.store(act_ptr + choice[None, :] * s_act + col[:, None], out.to(act_ptr.dtype.element_ty),
             mask=mask_t[None, :] & mask_n[:, None])


@triton.jit
def _down_kernel(
    act_ptr, p2_ptr, s2_ptr, tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr, weight_ptr, y_ptr,
    delta_ptr, s_act, s_pe, s_pr, s_se, s_sr, s_y, s_delta,
    L: tl.constexpr, I: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, ROUND_ACT: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PIPELINED: tl.constexpr, SCALES_AHEAD: tl.constexpr, TILED: tl.constexpr,
):
    e, choice, mask_t, busy = _routed_choices(tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr,
                                              BLOCK_T)
    if not busy:
        return
    row = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = row < L
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    G: tl.constexpr = BLOCK_K // 32
    p_d, s_d, r_d = _weight_rows(p2_ptr, s2_ptr, e, tl.program_id(1) * BLOCK_N, BLOCK_N, I, s_pe, s_pr, s_se, s_sr, TILED)
    sc = _scale_codes(s_d, r_d, mask_n, 0, s_sr, G, TILED)
    for k0 in range(0, I, BLOCK_K):
        if SCALES_AHEAD:    # the next step's scale codes, as in _gate_up_kernel
            sc_next = _scale_codes(s_d, r_d, mask_n, (k0 + BLOCK_K) % I, s_sr, G, TILED)
        else:
            sc = _scale_codes(s_d, r_d, mask_n, k0, s_sr, G, TILED)
            sc_next = sc
        x_a, x_b = _token_columns(act_ptr, choice, s_act, mask_t, k0, BLOCK_K, MODE, PIPELINED)
        acc = _rows_times_tokens(p_d, sc, r_d, mask_n, x_a, x_b, k0, acc, s_pr, BLOCK_K, MODE, IEEE, TILED)
        sc = sc_next
    if HAS_DELTA:       # a LoRA adapter's down rows of each (token, choice), before the routing weight
        acc += tl.load(delta_ptr + choice[None, :] * s_delta + row[:, None], mask=mask_t[None, :] & mask_n[:, None],
                       other=0.0)
    w = tl.load(weight_ptr + choice, mask=mask_t, other=0.0)
    acc = round_to(acc, ROUND_PRODUCTS)                                                # the down product
    tl.store(y_ptr + choice[None, :] * s_y + row[:, None], acc * w[None, :], mask=mask_t[None, :] & mask_n[:, None])


def merge_repeated_choices(topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """Routing that names an expert twice for one token (the router never does; the contract
    allows it) as routing that names it once with the summed weight: repeats get id -1 (no
    expert on any rank) and weight 0. On the device, no host synchronisation."""
    same = topk_ids[:, :, None] == topk_ids[:, None, :]                                  # [T, k, k]
    repeat = same.tril(-1).any(-1)                                                        # [T, k]
    merged = (same.to(topk_weights.dtype) * topk_weights[:, None, :]).sum(-1)
    return topk_ids.masked_fill(repeat, -1), merged.masked_fill(repeat, 0)


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
GEMV_MAX_TOKENS = 16      # the H200 sweep (fp16x2 gemv): 3.4x the tensor cores at T = 1, 2.5x at 4, 2.0x at 8,
#                            1.42x at 16, 0.82x at 32 (bench/moe_mxfp4.py, BENCHMARKS.md)
DEQUANT_MIN_TOKENS = 1024  # the H200 at k3-slice dims (grouped dequant vs 64-token tiles): 23.5 vs 66.2 ms at 8192,
#                            10.4 vs 18.2 at 2048, 8.6 vs 10.1 at 1024 (bench/moe_mxfp4.py); not measured below 1024


def default_mode(x: torch.Tensor) -> str:
    """gemv for bf16 decode batches of up to GEMV_MAX_TOKENS tokens on a GPU, dot_scaled for
    larger bf16 batches, dequant (moe_mxfp4_dequant.py) from DEQUANT_MIN_TOKENS; decode
    otherwise (module docstring)."""
    if x.dtype != torch.bfloat16 or not x.is_cuda or interpreted():
        return "decode"
    if x.shape[0] >= DEQUANT_MIN_TOKENS:
        return "dequant"
    return "gemv" if x.shape[0] <= GEMV_MAX_TOKENS else "dot_scaled"


GROUPED_MAX_TOKENS = 64   # experts_forward_grouped's range (2..64 tokens): the decode batches of issue 27


def experts_forward_grouped(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None,
                            expert_start=0, dense_dispatch=False):
    """`k3.reference.experts_forward` (same signature and contract) with the gemv_grouped mode for
    bf16 decode batches of 2 to GROUPED_MAX_TOKENS tokens on a GPU (each expert's weight tile
    decoded once for its pairs), `default_mode` elsewhere: the nvidia plugin's experimental
    `moe_experts_grouped`, served in place of the promoted kernel when K3_NVIDIA_EXPERIMENTAL
    names it."""
    grouped = (x.dtype == torch.bfloat16 and x.is_cuda and not interpreted() and 2 <= x.shape[0] <= GROUPED_MAX_TOKENS)
    return experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                           linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch,
                           mode="gemv_grouped" if grouped else None)


FOLD_MAX_SCALE_CODE = 128    # 2^(code - 1), the folded PTX's multiplier, is a bf16 up to here
_MAX_CODE_ATTR = "_k3_max_scale_code"      # remembered on the scales tensor itself


def folding_safe(*weights: MXFP4Tensor) -> bool:
    """Whether every E8M0 scale code of `weights` is <= FOLD_MAX_SCALE_CODE, so decode_bf16 may
    take the folded PTX (one multiply a pair, not two). Each scales tensor is read on the host
    once and remembered with its version counter (a checkpoint loaded into it in place later is
    read again); during CUDA-graph capture, where no host read may happen, a tensor not read at
    its current version answers False (the general PTX)."""
    for w in weights:
        version, code = getattr(w.scales, _MAX_CODE_ATTR, (None, None))
        if version != w.scales._version:                  # never read, or written in place since
            if w.scales.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            code = int(w.scales.max()) if w.scales.numel() else 0
            setattr(w.scales, _MAX_CODE_ATTR, (w.scales._version, code))
        if code > FOLD_MAX_SCALE_CODE:
            return False
    return True


# the H100 sweeps (2026-12-06, bench/moe_mxfp4.py): this tile beat every other decode_bf16 and dot_scaled tile
# swept at 16 / 32 / 64 tokens, and the served fp32-product gemv at 16 (1,491 vs 1,805 us); on the tiled copy
# (k3.quant.mxfp4_tiles) 1,109 / 1,231 / 1,256 us, 59-60% of the weight-bytes floor (64 rows on 4 warps: 1-2% faster)
BF16_DECODE_TILE = dict(block_t=16, block_n=128, block_k=64, num_warps=8, stages=3)
BF16_DECODE_MIN_TOKENS = 16      # measured from 16 tokens; the gemv keeps smaller batches


def experts_forward_bf16_decode(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None,
                                expert_start=0, dense_dispatch=False):
    """`k3.reference.experts_forward` (same signature and contract) with the decode_bf16 mode
    (BF16_DECODE_TILE) for bf16 batches on a GPU of BF16_DECODE_MIN_TOKENS up to
    DEQUANT_MIN_TOKENS - 1 tokens (where `default_mode` picks the gemv or dot_scaled), `default_mode`
    elsewhere: the nvidia plugin's promoted `moe_experts_bf16`, on the experts its
    `k3_process_weights` repacked tile-major (`k3.quant.mxfp4_tiles`; every mode reads them, and the
    checkpoint layout too)."""
    mode = default_mode(x)
    mxfp4 = isinstance(w13, MXFP4Tensor) and isinstance(w2, MXFP4Tensor)      # dense experts: experts_forward's
    if mxfp4 and (mode == "dot_scaled" or (mode == "gemv" and x.shape[0] >= BF16_DECODE_MIN_TOKENS)):
        return experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                               linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch,
                               mode="decode_bf16",
                               ptx=False if interpreted() else "folded" if folding_safe(w13, w2) else True,
                               **BF16_DECODE_TILE)
    return experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                           linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)


PREFILL_TOKENS = 512      # from here on an expert sees ~T*k/E >= 64 tokens: larger token tiles


def launch_options(t: int, mode: str) -> dict:
    """Tile sizes by batch and mode: the fastest of bench/moe_mxfp4.py's sweep on the H200 at
    k3-slice dimensions (BENCHMARKS.md): gemv 32 rows (4 a thread) x 512 columns on 4 warps, the
    served in the fp32-product form (147 us at one token, 1,697 at 16, its best in the ninth
    session; the fp16x2 form summing a group's four code words in fp16 took 122 / 1,452 but rounds
    where no other mode does: issue 32);
    for the tensor-core modes 64 rows x 128 columns for one token, 128 x 64 on 8 warps above;
    dot_scaled prefill batches (PREFILL_TOKENS and up) 64 tokens x 128 rows a tile on 4 warps, 4 stages
    (T=1024: 10.1 ms vs 18.1 ms with the 16-token tiles; T=8192: 66.3 vs 136.8 ms)."""
    if mode == "gemv":      # the fastest at 1-16 tokens (prefetch was slower for the fp16x2 form; not re-swept)
        return dict(block_t=1, block_n=32, block_k=512, num_warps=4, stages=1, row_split=4, prefetch=False, chain=4)
    if mode == "gemv_grouped":      # the gemv's served form, group_tokens pairs a tile; slower than the served
        #                             modes at every swept batch (BENCHMARKS.md, 2026-12-04), so experimental only
        return dict(block_t=1, block_n=32, block_k=512, num_warps=4, stages=1, row_split=4, chain=4,
                    group_tokens=2 if t <= 8 else 4 if t <= 32 else 8)
    if t == 1:
        return dict(block_t=16, block_n=64, block_k=128, num_warps=4)
    if t >= PREFILL_TOKENS and mode == "dot_scaled":        # (fp32 "decode" tiles keep their registers)
        return dict(block_t=64, block_n=128, block_k=64, num_warps=4, stages=4)
    return dict(block_t=16, block_n=128, block_k=64, num_warps=8)


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                    dense_dispatch=False, mode=None, block_t=None, block_n=None, block_k=None, num_warps=None,
                    stages=None, row_split=None, prefetch=None, half=None, chain=None, ieee=None, group_tokens=None,
                    ptx=None, pipelined_loads=True, scales_ahead=None):
    """`k3.reference.experts_forward` over MXFP4 experts (same signature and contract).

    mode (one of MODES; None: `default_mode`), block_t (tokens per program,
    >= 16 for the tensor cores; gemv takes one), block_n (weight rows per program), block_k (columns per step, a power
    of two, halved until it divides L and I), num_warps, stages (the software-pipeline depth),
    row_split (gemv: weight rows each thread holds, sharing its activation loads), prefetch
    (gemv: each step's weights loaded one step ahead), half (gemv: fp16x2 products on scaled
    fp16 activations; None: only under K3_LEGACY_ROUNDING, for bf16 activations), chain (gemv's fp16x2 form: code words summed in
    fp16 before each fp32 add, 1 or 4), ieee (dot_scaled / decode: IEEE fp32 products; None: for
    fp32 activations, tf32 otherwise; True where the target has no tf32, AMD's gfx950),
    group_tokens (gemv_grouped: pairs of one expert a tile, one of 1, 2, 4, 8), ptx (decode_bf16:
    the PTX decode of bf16 pairs; None: on a GPU, not under the interpreter; False: fp32 bit placement;
    "folded": the PTX with the bias in the scale, correct only while every E8M0 scale code is <= 128,
    for measuring what the second multiply costs), pipelined_loads (the tensor-core modes: each
    step's scale codes loaded a step ahead and the activation columns as contiguous rows, which
    the software pipeline loads ahead with the codes; False: both loaded where they are used, a
    round trip to memory every step, as before issue 27, for benchmarks), scales_ahead (None: with
    pipelined_loads; False with it, for benchmarks: the scale codes loaded in their step):
    launch options for benchmarks and platform tables (None: `launch_options` for this batch).
    w13 and w2 may both be tile-major (`k3.quant.mxfp4_tiles.TileMajorMXFP4`): every mode but
    gemv_grouped reads them as such, with the checkpoint layout's result bit for bit.
    """
    tiled = moe_mxfp4_layout.tile_pair(w13, w2) is not None
    if not covers(x, w13, w2, activation):
        return torch_experts.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                   linear_beta=linear_beta, expert_start=expert_start, dense_dispatch=dense_dispatch)
    if activation == "situ" and beta is None:
        raise ValueError("experts_forward: beta is required for activation='situ' (K3: 4.0)")
    mode = mode or default_mode(x)
    if dense_dispatch and mode == "dequant":
        mode = "dot_scaled"                 # the caller needs no host synchronisation (graph capture)
    if mode not in MODES or (mode in ("dot_scaled", "decode_bf16", "dequant", "gemv_grouped")
                             and x.dtype != torch.bfloat16):
        raise ValueError(f"experts_forward: mode {mode!r} is not one of {MODES} (dot_scaled, decode_bf16, gemv_grouped "
                         f"and dequant take bf16 activations, got {x.dtype})")
    t, l = x.shape
    if t == 0:
        return torch.zeros_like(x)
    if mode == "dequant":
        return moe_mxfp4_dequant.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                                 linear_beta=linear_beta, expert_start=expert_start)
    chosen = launch_options(t, mode)
    block_t, block_n = block_t or chosen["block_t"], block_n or chosen["block_n"]
    block_k, num_warps = block_k or chosen["block_k"], num_warps or chosen["num_warps"]
    stages = stages or chosen.get("stages")
    inter = w13.shape[1] // 2
    while l % block_k or inter % block_k:               # a power of two dividing both (>= 32: covers)
        block_k //= 2
    if not tiled and mode in ("gemv", "gemv_grouped") and not moe_mxfp4_gemv.word_aligned(w13, w2):
        mode = "decode"                 # codes not readable as 32-bit words (a view at an odd offset)
    if mode == "gemv_grouped" and tiled:
        raise ValueError("experts_forward: gemv_grouped reads the checkpoint layout, not tile-major experts")
    if mode == "gemv_grouped":
        return moe_mxfp4_gemv_grouped.experts_forward(
            x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta, linear_beta=linear_beta,
            expert_start=expert_start, tokens=group_tokens or chosen["group_tokens"], block_n=block_n,
            block_k=block_k, num_warps=num_warps, stages=stages or 1, split=row_split or chosen["row_split"],
            chain=chain or chosen["chain"])
    if mode == "gemv":
        return moe_mxfp4_gemv.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                              linear_beta=linear_beta, expert_start=expert_start, block_n=block_n,
                                              block_k=block_k, num_warps=num_warps, stages=stages or 1,
                                              split=row_split or chosen.get("row_split", 1),
                                              prefetch=chosen.get("prefetch", False) if prefetch is None else prefetch,
                                              half=half, chain=chain or chosen.get("chain", 4))
    ieee = x.dtype == torch.float32 if ieee is None else bool(ieee)
    return tiled_experts(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta, linear_beta=linear_beta,
                         expert_start=expert_start, dot_scaled=mode == "dot_scaled", ieee=ieee, block_t=block_t,
                         bf16_decode=_bf16_decode_form(mode, ptx), pipelined_loads=pipelined_loads,
                         scales_ahead=scales_ahead,
                         block_n=block_n, block_k=block_k, num_warps=num_warps, stages=stages)


def _bf16_decode_form(mode: str, ptx) -> str | bool:
    """tiled_experts' bf16_decode for experts_forward's mode and ptx option."""
    if mode != "decode_bf16":
        return False
    form = "folded" if ptx == "folded" else "ptx" if (ptx is None and not interpreted()) or ptx is True else "bits"
    if form != "bits" and torch.version.hip is not None:
        raise ValueError("experts_forward: decode_bf16's PTX forms run on NVIDIA GPUs only; pass ptx=False on ROCm")
    return form


def tiled_experts(x, w13, w2, topk_weights, topk_ids, *, activation, beta, linear_beta, expert_start, dot_scaled, ieee,
                  block_t, block_n, block_k, num_warps, stages, delta13=None, delta2=None, bf16_decode=False,
                  pipelined_loads=True, scales_ahead=None):
    """The two tensor-core launches of the module docstring ("dot_scaled", or "decode" without
    dot_scaled). delta13: [T*k, 2I] fp32 rows added to each (token, choice)'s gate / up rows
    before the activation; delta2: a function of the activation rows [T*k, I] returning [T*k, L]
    fp32 rows added to the down rows before the routing weight (LoRA adapters,
    `triton_kernels.lora`); None: nothing added (the served experts). bf16_decode (bf16
    activations, not with dot_scaled): "decode_bf16", the codes decoded to bf16 in the kernel by
    "ptx" (GPU) or by fp32 "bits" (any; the interpreter); False: not this mode. pipelined_loads,
    scales_ahead: `experts_forward`'s. With tile-major w13 and w2 (`k3.quant.mxfp4_tiles`)
    block_n must divide 128, and block_k is cut to 64 at most."""
    t, l = x.shape
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    # the tensor-core grid holds T tokens per expert: fold repeated choices
    topk_ids, topk_weights = merge_repeated_choices(topk_ids, topk_weights)
    order, starts, counts, tile_expert, tile_start = expert_tile_grid(topk_ids, expert_start, e_local, block_t)
    y = torch.zeros(t * topk, l, dtype=torch.float32, device=x.device)                # rows of other ranks stay 0
    weights = topk_weights.reshape(-1).to(torch.float32)
    if bf16_decode not in (False, "ptx", "bits", "folded"):
        raise ValueError(f"tiled_experts: bf16_decode is False, 'ptx', 'bits' or 'folded', got {bf16_decode!r}")
    if bf16_decode and (dot_scaled or x.dtype != torch.bfloat16):
        raise ValueError("tiled_experts: bf16_decode takes bf16 activations and excludes dot_scaled")
    tiled = moe_mxfp4_layout.tile_pair(w13, w2) is not None
    if tiled:
        block_k = min(block_k, moe_mxfp4_layout.TILE_COLS)       # a step within one column tile (T = 1's 128)
        if moe_mxfp4_layout.TILE_ROWS % block_n or moe_mxfp4_layout.TILE_COLS % block_k:
            raise ValueError(f"tiled_experts: tile-major experts need block_n dividing {moe_mxfp4_layout.TILE_ROWS} "
                             f"and block_k {moe_mxfp4_layout.TILE_COLS}, got {block_n} and {block_k}")
    bf16_operands = dot_scaled or bf16_decode
    act = torch.empty(t * topk, inter, dtype=torch.bfloat16 if bf16_operands else torch.float32, device=x.device)
    ieee = x.dtype == torch.float32 if ieee is None else bool(ieee)
    legacy = rounding.legacy()
    common = dict(MODE=0 if dot_scaled else {"folded": 4, "ptx": 3, "bits": 2}.get(bf16_decode, 1), IEEE=ieee,
                  ROUND_ACT=0 if legacy else rounding.round_code(x.dtype),
                  ROUND_PRODUCTS=0 if legacy else rounding.round_code(x.dtype), BLOCK_T=block_t, BLOCK_N=block_n,
                  BLOCK_K=block_k, PIPELINED=bool(pipelined_loads), TILED=tiled,
                  SCALES_AHEAD=bool(pipelined_loads) if scales_ahead is None else bool(scales_ahead),
                  num_warps=num_warps, **({"num_stages": stages} if stages else {}))
    # the expert and row strides of the codes and scales (tile-major: a row's within its tile)
    strides13, strides2 = ((w.packed.stride(0), w.packed.stride(-2), w.scales.stride(0), w.scales.stride(-2))
                           for w in (w13, w2))
    grid_tiles = tile_expert.numel()
    d13 = y if delta13 is None else delta13                                           # y: a pointer never read
    _gate_up_kernel[(grid_tiles, triton.cdiv(inter, block_n))](
        x, w13.packed, w13.scales, tile_expert, tile_start, order, starts, counts, act, d13,
        x.stride(0), *strides13, act.stride(0), d13.stride(0),
        topk, float(beta or 1.0), float(linear_beta or 1.0),
        L=l, I=inter, SITU=activation == "situ", HAS_LINEAR_BETA=linear_beta is not None,
        HAS_DELTA=delta13 is not None, **common,
    )
    d2 = None if delta2 is None else delta2(act)
    _down_kernel[(grid_tiles, triton.cdiv(l, block_n))](
        act, w2.packed, w2.scales, tile_expert, tile_start, order, starts, counts, weights, y, y if d2 is None else d2,
        act.stride(0), *strides2, y.stride(0), l if d2 is None else d2.stride(0),
        L=l, I=inter, HAS_DELTA=d2 is not None, **common,
    )
    return y.view(t, topk, l).sum(1).to(x.dtype)
