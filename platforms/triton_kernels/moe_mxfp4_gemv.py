"""The "gemv" mode of the MXFP4 routed experts (moe_mxfp4.experts_forward): one program per
((token, choice), block of BLOCK_N weight rows), no tensor cores, for decode steps where an
expert sees one token or a few.

Why: with one token per expert the matrix product is a matrix-vector product, and the tensor
core path (`tl.dot_scaled`) pays for it twice: Triton upcasts the E2M1 codes into the MMA's
operand layout through shared memory and pads the one token to a 16-wide tile, so its loop is
bound by instruction latency, not bytes (12% of the weight-bytes roofline at T = 1 on the H200,
BENCHMARKS.md). Here each thread loads a 16-byte run of packed codes (one E8M0 group: 32
weights) as four 32-bit words with one vector load and builds fp16 pairs from them by integer
shifts and masks (an E2M1 code placed as an fp16's sign, two lowest exponent bits and top
mantissa bit is its value / 2^14; nibbles c and c + 4 of a word land in one register's two
halves: `e2m1_pairs`). Each thread holds the same words of several rows (row_split, 4 served),
so its activation loads serve all of them. Two forms of the products:
  - fp16x2 (bf16 activations, served; moe_mxfp4_gemv_half.py): the activations come as fp16
    pairs matching the code pairs, each 32-column group scaled by its own power of two so fp16
    holds them exactly, and one `fma.rn.f16x2` multiplies and adds two weights; a group's 16
    pair products are summed in fp16 (exact products, rounded adds), then once in fp32 with
    both scales. About 3.3 instructions a weight in the SASS loop (two of them the decode);
    122 us at T = 1 on the H200, 55% of the weight-bytes roofline (BENCHMARKS.md, ninth session);
  - fp32 (fp32 / fp16 activations; `_fp32_step_sums`): each fp16 code widened to fp32 and
    multiplied with fp32 FMAs by activations in planes of x's dtype (plane c holds column 8j + c
    of every word j): about five instructions a weight, 147 us at T = 1.
The group scale multiplies a group's sum once, and the partial sums are reduced across the row
once, after the loop. Loading the weights a step ahead (prefetch) helped the fp32 form from two
tokens on, not the fp16x2 one; decoding to fp16 for `tl.dot` (a shared-memory round trip and a
barrier a step at low occupancy: 214-359 us at T = 1, commit 8710e52) was slower.

Program ((token, choice) n, row block) of
  - `gate_up_kernel`: gate rows and up rows of w13 of the expert n chose against x's token row,
    SiTU-GLU (or SiLU-GLU) in fp32, one row of activations per (token, choice);
  - `down_kernel`: rows of w2 against that activation row, times the routing weight, one fp32
    row per (token, choice) (zeros for an expert of another rank).
No grouping by expert (moe_mxfp4's argsort, counts and active list took 57 of the 261 us of a
one-token step on the H200): the programs of one row block for all choices run in the same
wave, so an expert chosen by two tokens is read from DRAM once and from L2 the second time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreted, rounding
from .rounding import round_to
from .moe_mxfp4_common import (e2m1_pairs, e8m0_multiplier, fp16_bits_to_f32, gated_activation, half_group_scales,
                               tile_major_row)
from .moe_mxfp4_gemv_half import _half_planes_kernel, _half_step_sums, _pair_plane_index
from .moe_mxfp4_layout import tile_pair


@triton.jit
def _fp32_step_sums(w, sc, k0, src_ptr, L: tl.constexpr, G: tl.constexpr):
    """One step of `_rows_dot_token` without HALF: the [RB, G, U] group sums (fp32, scaled) of code
    words w [RB, G, U, 4] (E8M0 codes sc [RB, G, U]) against activation planes src, each fp16 code
    widened to fp32 and multiplied with fp32 FMAs."""
    PLANE: tl.constexpr = L // 8
    word = k0 // 8 + tl.arange(0, G)[:, None] * 4 + tl.arange(0, 4)[None, :]                 # [G, 4]
    x0 = tl.load(src_ptr + word)[None, :, None, :].to(tl.float32)                             # [1, G, 1, 4]: 8j + c
    x1 = tl.load(src_ptr + PLANE + word)[None, :, None, :].to(tl.float32)
    x2 = tl.load(src_ptr + 2 * PLANE + word)[None, :, None, :].to(tl.float32)
    x3 = tl.load(src_ptr + 3 * PLANE + word)[None, :, None, :].to(tl.float32)
    x4 = tl.load(src_ptr + 4 * PLANE + word)[None, :, None, :].to(tl.float32)
    x5 = tl.load(src_ptr + 5 * PLANE + word)[None, :, None, :].to(tl.float32)
    x6 = tl.load(src_ptr + 6 * PLANE + word)[None, :, None, :].to(tl.float32)
    x7 = tl.load(src_ptr + 7 * PLANE + word)[None, :, None, :].to(tl.float32)
    p04, p15, p26, p37 = e2m1_pairs(w)                                                       # fp16 pairs (c, c + 4)
    part = fp16_bits_to_f32(p04) * x0                                                        # one fma chain
    part += fp16_bits_to_f32(p04 >> 16) * x4
    part += fp16_bits_to_f32(p15) * x1
    part += fp16_bits_to_f32(p15 >> 16) * x5
    part += fp16_bits_to_f32(p26) * x2
    part += fp16_bits_to_f32(p26 >> 16) * x6
    part += fp16_bits_to_f32(p37) * x3
    part += fp16_bits_to_f32(p37 >> 16) * x7
    # two exact steps: 2^14 folded into the scale would overflow fp32 for scale codes above 241
    return (tl.sum(part, axis=3) * 16384.0) * e8m0_multiplier(sc.to(tl.int32))


@triton.jit
def first_step_pointers(packed_ptr, scales_ptr, e, row0, N, s_pe, s_pr, s_se, s_sr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, K: tl.constexpr = 0, TILED: tl.constexpr = False):
    """The code words [RB, G, U, 4] (uint32) and E8M0 scales [RB, G, U] of expert e's rows
    row0 + `_block_rows` for the first BLOCK_K columns (`_step_offsets` moves them to step k0),
    with their masks (rows past N). TILED: the experts' tile-major copy (moe_mxfp4_layout.py;
    s_pr, s_sr: 32 and 2, a row's stride within its tile; K columns; BLOCK_N divides 128 and
    row0 is a multiple of it, so the rows lie in one row tile): group g of a step in column tile
    g / 2 (4 KB of codes and 256 bytes of scales apart), at 16 * (g % 2) bytes within it."""
    G: tl.constexpr = BLOCK_K // 32
    RB: tl.constexpr = BLOCK_N // SPLIT
    rows = row0 + tl.arange(0, RB)[:, None] + tl.arange(0, SPLIT)[None, :] * RB               # [RB, U]
    mask_r = rows < N
    group_in_step = tl.arange(0, G)
    if TILED:
        rows_in = tile_major_row(row0, K) + tl.arange(0, RB)[:, None] + tl.arange(0, SPLIT)[None, :] * RB
        group_words = (group_in_step // 2) * 1024 + (group_in_step % 2) * 4                   # 4 KB, 16 bytes
        group_scales = (group_in_step // 2) * 256 + group_in_step % 2
    else:
        rows_in = rows
        group_words = group_in_step * 4
        group_scales = group_in_step
    words_ptr = (packed_ptr + e * s_pe + rows_in[:, None, :, None] * s_pr).to(tl.pointer_type(tl.uint32), bitcast=True)
    step_words = words_ptr + (group_words[:, None] + tl.arange(0, 4)[None, :])[None, :, None, :]
    # [RB, G, U]. Triton loads these bytes as 4-byte vectors along G and gives the accumulator their
    # layout, so each step's sums cross shared memory (a barrier a step); declared not contiguous
    # (tl.max_contiguous 1) they load a byte a thread and the convert goes, but that measured slower
    # on the H200: 137 against 122 us at T = 1 for the HALF form (BENCHMARKS.md, ninth session)
    step_scales = scales_ptr + e * s_se + rows_in[:, None, :] * s_sr + group_scales[None, :, None]
    return step_words, step_scales, mask_r[:, None, :, None], mask_r[:, None, :]


@triton.jit
def _step_offsets(k0, TILED: tl.constexpr):
    """(code words, scale bytes) from `first_step_pointers`' first step to step k0 (a multiple
    of 64): the checkpoint layout's k0 / 8 and k0 / 32, or the tiled copy's whole column tiles."""
    if TILED:
        return (k0 // 64) * 1024, (k0 // 64) * 256
    return k0 // 8, k0 // 32


@triton.jit
def _rows_dot_token(packed_ptr, scales_ptr, e, row0, N, src_ptr, src_unscale_ptr, L: tl.constexpr,
                    BLOCK_K: tl.constexpr, s_pe, s_pr, s_se, s_sr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, HALF: tl.constexpr, CHAIN: tl.constexpr,
                    ASM: tl.constexpr, TILED: tl.constexpr = False):
    """sum_k W_e[r, k] * src[k] over k < L in fp32 for the BLOCK_N rows r = row0 + i (rows past N
    read as zero): [BLOCK_N / SPLIT, SPLIT], row row0 + u * BLOCK_N / SPLIT + i at [i, u]. src
    points at the token's activations: with HALF, fp16 pair planes and src_unscale its group
    unscales (moe_mxfp4_gemv_half.py); else planes [8, L / 8] of fp32 / bf16 / fp16, src[c, j] =
    column 8j + c, so each thread's activations for its words are one contiguous vector load in
    the layout of the words themselves (src_unscale unread). Each step's sums come from
    `_half_step_sums` or `_fp32_step_sums`.

    The codes are read as uint32 words: word j of a 32-column group holds columns 8j..8j+7, one
    nibble each (column 8j + c in nibble c). Nibbles c and c + 4 are 16 bits apart, so one
    shift-and-mask builds both as an fp16 pair (value / 2^14) in one register's halves.

    SPLIT: the rows come as SPLIT blocks of BLOCK_N / SPLIT that every thread holds one row of
    (the block index is the third of the four tile dimensions: Triton's layouts spread threads
    over the first two and repeat the last non-contiguous one in each thread's registers), so a thread
    loads and widens its activations once for SPLIT weight rows: the activation loads, not the
    weight bytes, were what bound the one-row-per-thread form (BENCHMARKS.md).
    PREFETCH: each step's codes and scales are loaded one step ahead, into registers, so a warp
    has loads in flight while it decodes (without it, a warp waits out DRAM latency each step).
    TILED: the experts' tile-major copy (`first_step_pointers`)."""
    G: tl.constexpr = BLOCK_K // 32
    RB: tl.constexpr = BLOCK_N // SPLIT
    step_words, step_scales, mask_w, mask_s = first_step_pointers(packed_ptr, scales_ptr, e, row0, N, s_pe, s_pr,
                                                                  s_se, s_sr, BLOCK_K, BLOCK_N, SPLIT, L, TILED)
    acc = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    if PREFETCH:
        w_next = tl.load(step_words, mask=mask_w, other=0)
        sc_next = tl.load(step_scales, mask=mask_s, other=127)
    for k0 in tl.range(0, L, BLOCK_K, num_stages=STAGES):
        if PREFETCH:
            # this step's codes and scales were loaded during the previous step; the next
            # step's (the last step again at the end: a cache hit, no mask) load during this one
            w = w_next
            sc = sc_next
            words, scales = _step_offsets(tl.minimum(k0 + BLOCK_K, L - BLOCK_K), TILED)
            w_next = tl.load(step_words + words, mask=mask_w, other=0)
            sc_next = tl.load(step_scales + scales, mask=mask_s, other=127)
        else:
            words, scales = _step_offsets(k0, TILED)
            w = tl.load(step_words + words, mask=mask_w, other=0)                            # [RB, G, U, 4]
            sc = tl.load(step_scales + scales, mask=mask_s, other=127)
        if HALF:
            acc += _half_step_sums(w, sc, k0, src_ptr, src_unscale_ptr, L, G, RB, SPLIT, CHAIN, ASM)
        else:
            acc += _fp32_step_sums(w, sc, k0, src_ptr, L, G)
    return tl.sum(acc, axis=1)


@triton.jit
def _local_expert(ids_ptr, expert_start, E_LOCAL):
    """This program's (token, choice) n = program_id(0), its expert's local index (int64: the
    expert stride times it can pass 2^31) and whether this rank holds that expert."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + n).to(tl.int64) - expert_start
    return n, e, (e >= 0) & (e < E_LOCAL)


@triton.jit
def _block_rows(BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """This program's rows in `_rows_dot_token`'s [BLOCK_N / SPLIT, SPLIT] arrangement."""
    RB: tl.constexpr = BLOCK_N // SPLIT
    return tl.program_id(1) * BLOCK_N + tl.arange(0, RB)[:, None] + tl.arange(0, SPLIT)[None, :] * RB


@triton.jit
def gate_up_kernel(
    x_ptr, x_unscale_ptr, p13_ptr, s13_ptr, ids_ptr, act_ptr, act_unscale_ptr,
    s_x, s_xu, s_pe, s_pr, s_se, s_sr, s_act, s_au,
    TOPK, expert_start, E_LOCAL, beta, linear_beta,
    L: tl.constexpr, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, ROUND_ACT: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, PREFETCH: tl.constexpr, HALF: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr,
    TILED: tl.constexpr,
):
    n, e, local = _local_expert(ids_ptr, expert_start, E_LOCAL)
    if local:
        col0 = tl.program_id(1) * BLOCK_N
        x_row, x_unscale = x_ptr + (n // TOPK) * s_x, x_unscale_ptr + (n // TOPK) * s_xu
        g = _rows_dot_token(p13_ptr, s13_ptr, e, col0, I, x_row, x_unscale, L, BLOCK_K, s_pe, s_pr, s_se, s_sr,
                            STAGES, SPLIT, BLOCK_N, PREFETCH, HALF, CHAIN, ASM, TILED)
        u = _rows_dot_token(p13_ptr, s13_ptr, e, I + col0, 2 * I, x_row, x_unscale, L, BLOCK_K, s_pe, s_pr, s_se,
                            s_sr, STAGES, SPLIT, BLOCK_N, PREFETCH, HALF, CHAIN, ASM, TILED)
        g, u = round_to(g, ROUND_PRODUCTS), round_to(u, ROUND_PRODUCTS)                  # the gate/up products
        store_activation_row(gated_activation(g, u, beta, linear_beta, SITU, HAS_LINEAR_BETA), col0,
                             act_ptr + n * s_act, act_unscale_ptr + n * s_au, n >= 0, I, BLOCK_N, SPLIT, HALF,
                             ROUND_ACT)


@triton.jit
def store_activation_row(out, col0, row_ptr, unscale_ptr, valid, I: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLIT: tl.constexpr, HALF: tl.constexpr, ROUND_ACT: tl.constexpr):
    """A program's gate/up activations out [RB, U] (columns col0 + `_block_rows`), rounded to the
    model's 16-bit dtype (ROUND_ACT, `rounding.round_to`: where every variant rounds them), stored
    as the down kernel reads them, at row_ptr (and, with HALF, the group unscales at unscale_ptr);
    nothing is stored unless valid (a scalar)."""
    out = round_to(out, ROUND_ACT)
    col = _block_rows(BLOCK_N, SPLIT)                                                         # [RB, U]
    if HALF:            # the down kernel's input: fp16 pair planes, a power-of-two scale per 32 columns
        group = (col - col0) // 32
        scale = tl.zeros(out.shape, dtype=tl.float32)
        for gi in tl.static_range(BLOCK_N // 32):
            in_group = group == gi
            group_scale, unscale = half_group_scales(tl.max(tl.where(in_group, tl.abs(out), 0.0)))
            scale = tl.where(in_group, group_scale, scale)
            index = col0 // 32 + gi
            tl.store(unscale_ptr + index, unscale, mask=(index < I // 32) & valid)
        tl.store(row_ptr + _pair_plane_index(col, I), (out * scale).to(tl.float16), mask=(col < I) & valid)
    else:
        tl.store(row_ptr + (col % 8) * (I // 8) + col // 8, out, mask=(col < I) & valid)     # planes, as x


@triton.jit
def down_kernel(
    act_ptr, act_unscale_ptr, p2_ptr, s2_ptr, ids_ptr, weight_ptr, y_ptr,
    s_act, s_au, s_pe, s_pr, s_se, s_sr, s_y,
    expert_start, E_LOCAL,
    L: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, PREFETCH: tl.constexpr, HALF: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr, TILED: tl.constexpr,
):
    n, e, local = _local_expert(ids_ptr, expert_start, E_LOCAL)
    row = _block_rows(BLOCK_N, SPLIT)                                                         # [RB, U]
    mask_n = row < L
    if local:
        out = _rows_dot_token(p2_ptr, s2_ptr, e, tl.program_id(1) * BLOCK_N, L, act_ptr + n * s_act,
                              act_unscale_ptr + n * s_au, I, BLOCK_K, s_pe, s_pr, s_se, s_sr, STAGES, SPLIT, BLOCK_N,
                              PREFETCH, HALF, CHAIN, ASM, TILED)
        out = round_to(out, ROUND_PRODUCTS)                                               # the down product
        tl.store(y_ptr + n * s_y + row, out * tl.load(weight_ptr + n).to(tl.float32), mask=mask_n)
    else:                                                 # another rank's expert: contributes nothing
        tl.store(y_ptr + n * s_y + row, tl.zeros(row.shape, dtype=tl.float32), mask=mask_n)


@triton.jit
def _sum_choices_kernel(y_ptr, out_ptr, s_y, s_out, TOPK: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sum over the token's TOPK rows of y (fp32, in choice order, as
    y.view(T, TOPK, L).sum(1) adds them), cast to out's dtype."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < L
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + choice) * s_y + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * s_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def half_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, L] as the fp16x2 form reads it: fp16 pair planes as int32 words [T, L / 2] (see
    _pair_plane_index) and one fp32 unscale per 32 columns [T, L / 32]."""
    t, l = x.shape
    x_half = torch.empty(t, l, dtype=torch.float16, device=x.device)
    x_unscale = torch.empty(t, l // 32, dtype=torch.float32, device=x.device)
    _half_planes_kernel[(t, triton.cdiv(l // 32, 16))](x, x_half, x_unscale, x.stride(0), x_half.stride(0),
                                                      x_unscale.stride(0), L=l, GROUPS=16, num_warps=4)
    return x_half.view(torch.int32), x_unscale


def word_aligned(w13, w2) -> bool:
    """Whether both experts' packed codes can be read as 32-bit words: base addresses and row
    and expert strides (bytes) multiples of 4."""
    return all(w.packed.data_ptr() % 4 == 0 and w.packed.stride(0) % 4 == 0 and w.packed.stride(1) % 4 == 0
               for w in (w13, w2))


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta, linear_beta, expert_start,
                    block_n, block_k, num_warps, stages=1, split=1, prefetch=False, half=None, chain=4,
                    legacy=None):
    """moe_mxfp4.experts_forward's gemv mode: [T, L] of x.dtype. No grouping by expert: one
    program per (token, choice) and row block reads the chosen expert itself (a token naming an
    expert twice simply runs it twice), so a decode step is the activations' re-layout, two
    launches and the sum over choices (one launch, cast included).

    A 16-bit model's gate/up products, activations and down products are rounded to its dtype,
    where every variant of the entry rounds them (`rounding`), and products are summed in fp32.
    half (None: only under `legacy`, for bf16 activations): fp16x2 products on scaled fp16 pair
    planes (`_half_step_sums`; block_n a multiple of 32), chain its words per fp32 sum (1 or 4):
    the products are exact but each half's 16 products of a group are summed in fp16, a rounding
    no other variant makes (issue 32); else fp32 products on activation planes in x's dtype
    (bf16 / fp16) or fp32.
    legacy (None: `rounding.legacy()`): the pre-issue-32 rounding (fp16x2 by default for bf16,
    only the activations rounded, to bf16 only). Tile-major w13 and w2 (`k3.quant.mxfp4_tiles`)
    are read as such; then block_n must divide 128 and block_k be a multiple of 64."""
    if block_n % split or (block_n // split) & (block_n // split - 1):
        raise ValueError(f"gemv: block_n {block_n} must be split {split} times a power of two")
    legacy = rounding.legacy() if legacy is None else legacy
    half = (legacy and x.dtype == torch.bfloat16) if half is None else half
    if half and (block_n % 32 or chain not in (1, 4)):
        raise ValueError(f"gemv: the fp16x2 form needs block_n a multiple of 32 (got {block_n}) and chain 1 or 4 "
                         f"(got {chain})")
    tiled = tile_pair(w13, w2) is not None
    if tiled and (128 % block_n or block_k % 64):
        raise ValueError(f"gemv: tile-major experts need block_n dividing 128 and block_k a multiple of 64, got "
                         f"{block_n} and {block_k}")
    t, l = x.shape
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    # the expert and row strides of the codes and scales (tile-major: a row's within its tile)
    strides13, strides2 = ((w.packed.stride(0), w.packed.stride(-2), w.scales.stride(0), w.scales.stride(-2))
                           for w in (w13, w2))
    weights = topk_weights.reshape(-1)
    if half:
        x_planes, x_unscale = half_planes(x)
        act = torch.empty(t * topk, inter, dtype=torch.float16, device=x.device)
        act_unscale = torch.empty(t * topk, inter // 32, dtype=torch.float32, device=x.device)
        act_words = act.view(torch.int32)
    else:
        # Planes in the narrowest dtype that holds them exactly: a bf16 / fp16 model's x as it is, and
        # the activation rows in the dtype the kernel rounds them to (a 16-bit model's), else fp32.
        plane_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        x_planes = x.to(plane_dtype).view(t, l // 8, 8).transpose(1, 2).contiguous()   # [T, 8, L/8]
        x_unscale = x_planes                                                            # (not read)
        rounded = x.dtype == torch.bfloat16 if legacy else rounding.round_code(x.dtype) > 0
        act_dtype = x.dtype if rounded else torch.float32
        act = act_words = torch.empty(t * topk, 8, inter // 8, dtype=act_dtype, device=x.device)
        act_unscale = act                                                               # (not read)
    y = torch.empty(t * topk, l, dtype=torch.float32, device=x.device)
    code = rounding.round_code(x.dtype)
    form = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split, PREFETCH=prefetch, HALF=half,
                CHAIN=chain, ASM=not interpreted(), ROUND_PRODUCTS=0 if legacy else code, TILED=tiled, num_warps=num_warps)
    gate_up_kernel[(t * topk, triton.cdiv(inter, block_n))](
        x_planes, x_unscale, w13.packed, w13.scales, ids, act, act_unscale,
        x_planes.stride(0), x_unscale.stride(0), *strides13, act.stride(0),
        act_unscale.stride(0), topk, expert_start, e_local, float(beta or 1.0), float(linear_beta or 1.0),
        L=l, I=inter, SITU=activation == "situ", HAS_LINEAR_BETA=linear_beta is not None,
        ROUND_ACT=(1 if x.dtype == torch.bfloat16 else 0) if legacy else code, **form,
    )
    down_kernel[(t * topk, triton.cdiv(l, block_n))](
        act_words, act_unscale, w2.packed, w2.scales, ids, weights, y,
        act_words.stride(0), act_unscale.stride(0), *strides2, y.stride(0),
        expert_start, e_local, L=l, I=inter, **form,
    )
    out = torch.empty(t, l, dtype=x.dtype, device=x.device)
    _sum_choices_kernel[(t, triton.cdiv(l, 1024))](y, out, y.stride(0), out.stride(0), TOPK=topk, L=l, BLOCK=1024,
                                                   num_warps=4)
    return out
