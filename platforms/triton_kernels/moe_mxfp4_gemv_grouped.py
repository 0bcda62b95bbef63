"""The "gemv_grouped" mode of the MXFP4 routed experts (moe_mxfp4.experts_forward): the gemv
mode's fp16x2 products (moe_mxfp4_gemv.py) with each weight tile loaded and decoded once for up to
TOKENS (token, choice) pairs routed to its expert, for decode batches of a few to a few dozen
tokens (issue 27: at k3-slice's 128 experts and top-16, 16 tokens put ~2.3 pairs on each active
expert and 64 tokens ~8, which the one-pair-per-program gemv reads and decodes again for each).

Program (tile, block of BLOCK_N weight rows): a tile is up to TOKENS pairs of one expert, cut
from the pairs grouped by expert on the device (moe_mxfp4_common.expert_tiles: no host
synchronisation, CUDA-graph capturable). Each step loads the expert's code words and scales once
and runs `_half_step_sums` for every pair of the tile: the decode of the words (shifts and masks)
is the same SSA value for all of them, so the compiler emits it once, and only the activation
loads and the fp16x2 products repeat per pair. Each pair's sums are computed exactly as the gemv
mode computes them (same steps, same order), so the two modes agree bit for bit, and a batch's
outputs do not depend on which of them its size picked (issue 32: variants rounding at the same
points).
  - `gate_up_kernel`: gate and up rows of w13 against the tile's token rows of x, SiTU-GLU (or
    SiLU-GLU) in fp32, one activation row per pair in the down kernel's fp16 pair planes;
  - `down_kernel`: rows of w2 against the tile's activation rows, times each pair's routing
    weight, one fp32 row per pair (rows of other ranks' pairs stay zero: no tile holds them);
then moe_mxfp4_gemv's sum over choices (one launch, cast included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreted
from .moe_mxfp4_common import expert_tile_grid, gated_activation
from .moe_mxfp4_gemv import _block_rows, _sum_choices_kernel, first_step_pointers, half_planes, store_activation_row
from .moe_mxfp4_gemv_half import _half_step_sums

TOKENS_SERVED = (1, 2, 4, 8)     # pairs a tile: one accumulator set each, unrolled (`_rows_dot_pairs`)


@triton.jit
def _tile(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr, TOKENS: tl.constexpr):
    """This program's tile (program_id(0)): its local expert (int64), the index of its first pair
    in the expert-sorted order and how many pairs it holds (<= 0: a tile past the last one)."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    offset = tl.load(tile_start_ptr + tile)
    n_valid = tl.minimum(tl.load(count_ptr + e) - offset, TOKENS)
    return e, tl.load(start_ptr + e) + offset, n_valid


@triton.jit
def _pair(order_ptr, first, n_valid, i: tl.constexpr):
    """Slot i's (token, choice) pair (int64); slots past n_valid repeat the last pair (their
    sums are computed on valid memory and never stored)."""
    return tl.load(order_ptr + first + tl.minimum(i, n_valid - 1)).to(tl.int64)


@triton.jit
def _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, i: tl.constexpr,
               L: tl.constexpr, G: tl.constexpr, RB: tl.constexpr, SPLIT: tl.constexpr, CHAIN: tl.constexpr,
               ASM: tl.constexpr):
    """`_half_step_sums` of this step's words against slot i's source row (its pair // DIV)."""
    r = _pair(order_ptr, first, n_valid, i) // DIV
    return _half_step_sums(w, sc, k0, src_ptr + r * s_src, unscale_ptr + r * s_un, L, G, RB, SPLIT, CHAIN, ASM)


@triton.jit
def _rows_dot_pairs(packed_ptr, scales_ptr, e, row0, N, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first,
                    n_valid, DIV, L: tl.constexpr, BLOCK_K: tl.constexpr, s_pe, s_pr, s_se, s_sr,
                    STAGES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, CHAIN: tl.constexpr,
                    ASM: tl.constexpr, TOKENS: tl.constexpr):
    """moe_mxfp4_gemv's `_rows_dot_token` (fp16x2 form, no prefetch) for the tile's pairs at once:
    eight [RB, U] fp32 sums, slot i's against the source row of pair i (src rows: fp16 pair planes
    with stride s_src, unscales with stride s_un, row = pair // DIV); slots from TOKENS on are zero."""
    G: tl.constexpr = BLOCK_K // 32
    RB: tl.constexpr = BLOCK_N // SPLIT
    step_words, step_scales, mask_w, mask_s = first_step_pointers(packed_ptr, scales_ptr, e, row0, N, s_pe, s_pr,
                                                                  s_se, s_sr, BLOCK_K, BLOCK_N, SPLIT)
    acc0 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc1 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc2 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc3 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc4 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc5 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc6 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    acc7 = tl.zeros((RB, G, SPLIT), dtype=tl.float32)
    for k0 in tl.range(0, L, BLOCK_K, num_stages=STAGES):
        w = tl.load(step_words + k0 // 8, mask=mask_w, other=0)                              # [RB, G, U, 4]
        sc = tl.load(step_scales + k0 // 32, mask=mask_s, other=127)
        acc0 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 0,
                           L, G, RB, SPLIT, CHAIN, ASM)
        if TOKENS > 1:
            acc1 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 1,
                               L, G, RB, SPLIT, CHAIN, ASM)
        if TOKENS > 2:
            acc2 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 2,
                               L, G, RB, SPLIT, CHAIN, ASM)
            acc3 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 3,
                               L, G, RB, SPLIT, CHAIN, ASM)
        if TOKENS > 4:
            acc4 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 4,
                               L, G, RB, SPLIT, CHAIN, ASM)
            acc5 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 5,
                               L, G, RB, SPLIT, CHAIN, ASM)
            acc6 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 6,
                               L, G, RB, SPLIT, CHAIN, ASM)
            acc7 += _step_sums(w, sc, k0, src_ptr, s_src, unscale_ptr, s_un, order_ptr, first, n_valid, DIV, 7,
                               L, G, RB, SPLIT, CHAIN, ASM)
    return (tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1),
            tl.sum(acc4, axis=1), tl.sum(acc5, axis=1), tl.sum(acc6, axis=1), tl.sum(acc7, axis=1))


@triton.jit
def _store_gated(g, u, i: tl.constexpr, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au,
                 beta, linear_beta, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                 ROUND_ACT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Slot i's gated activations into its pair's activation row (if the slot holds a pair)."""
    n = _pair(order_ptr, first, n_valid, i)
    store_activation_row(gated_activation(g, u, beta, linear_beta, SITU, HAS_LINEAR_BETA), col0,
                         act_ptr + n * s_act, act_unscale_ptr + n * s_au, i < n_valid, I, BLOCK_N, SPLIT, True,
                         ROUND_ACT)


@triton.jit
def gate_up_kernel(
    x_ptr, x_unscale_ptr, p13_ptr, s13_ptr, tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr,
    act_ptr, act_unscale_ptr, s_x, s_xu, s_pe, s_pr, s_se, s_sr, s_act, s_au, TOPK, beta, linear_beta,
    L: tl.constexpr, I: tl.constexpr, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, ROUND_ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, CHAIN: tl.constexpr,
    ASM: tl.constexpr, TOKENS: tl.constexpr,
):
    e, first, n_valid = _tile(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr, TOKENS)
    if n_valid > 0:
        col0 = tl.program_id(1) * BLOCK_N
        g0, g1, g2, g3, g4, g5, g6, g7 = _rows_dot_pairs(
            p13_ptr, s13_ptr, e, col0, I, x_ptr, s_x, x_unscale_ptr, s_xu, order_ptr, first, n_valid, TOPK, L,
            BLOCK_K, s_pe, s_pr, s_se, s_sr, STAGES, SPLIT, BLOCK_N, CHAIN, ASM, TOKENS)
        u0, u1, u2, u3, u4, u5, u6, u7 = _rows_dot_pairs(
            p13_ptr, s13_ptr, e, I + col0, 2 * I, x_ptr, s_x, x_unscale_ptr, s_xu, order_ptr, first, n_valid, TOPK,
            L, BLOCK_K, s_pe, s_pr, s_se, s_sr, STAGES, SPLIT, BLOCK_N, CHAIN, ASM, TOKENS)
        _store_gated(g0, u0, 0, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                     linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
        if TOKENS > 1:
            _store_gated(g1, u1, 1, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
        if TOKENS > 2:
            _store_gated(g2, u2, 2, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
            _store_gated(g3, u3, 3, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
        if TOKENS > 4:
            _store_gated(g4, u4, 4, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
            _store_gated(g5, u5, 5, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
            _store_gated(g6, u6, 6, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)
            _store_gated(g7, u7, 7, order_ptr, first, n_valid, col0, act_ptr, act_unscale_ptr, s_act, s_au, beta,
                         linear_beta, I, SITU, HAS_LINEAR_BETA, ROUND_ACT, BLOCK_N, SPLIT)


@triton.jit
def _store_down(out, i: tl.constexpr, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y):
    """Slot i's down-projection rows times its routing weight into its pair's output row."""
    n = _pair(order_ptr, first, n_valid, i)
    tl.store(y_ptr + n * s_y + row, out * tl.load(weight_ptr + n).to(tl.float32), mask=mask_n & (i < n_valid))


@triton.jit
def down_kernel(
    act_ptr, act_unscale_ptr, p2_ptr, s2_ptr, tile_expert_ptr, tile_start_ptr, order_ptr, start_ptr, count_ptr,
    weight_ptr, y_ptr, s_act, s_au, s_pe, s_pr, s_se, s_sr, s_y,
    L: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr, TOKENS: tl.constexpr,
):
    e, first, n_valid = _tile(tile_expert_ptr, tile_start_ptr, start_ptr, count_ptr, TOKENS)
    if n_valid > 0:
        row0 = tl.program_id(1) * BLOCK_N
        o0, o1, o2, o3, o4, o5, o6, o7 = _rows_dot_pairs(
            p2_ptr, s2_ptr, e, row0, L, act_ptr, s_act, act_unscale_ptr, s_au, order_ptr, first, n_valid, 1, I,
            BLOCK_K, s_pe, s_pr, s_se, s_sr, STAGES, SPLIT, BLOCK_N, CHAIN, ASM, TOKENS)
        row = _block_rows(BLOCK_N, SPLIT)                                                     # [RB, U]
        mask_n = row < L
        _store_down(o0, 0, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
        if TOKENS > 1:
            _store_down(o1, 1, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
        if TOKENS > 2:
            _store_down(o2, 2, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
            _store_down(o3, 3, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
        if TOKENS > 4:
            _store_down(o4, 4, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
            _store_down(o5, 5, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
            _store_down(o6, 6, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)
            _store_down(o7, 7, order_ptr, first, n_valid, row, mask_n, weight_ptr, y_ptr, s_y)


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta, linear_beta, expert_start,
                    tokens, block_n, block_k, num_warps, stages=1, split=4, chain=4):
    """moe_mxfp4.experts_forward's gemv_grouped mode for bf16 activations: [T, L] bf16, equal bit
    for bit to the gemv mode's fp16x2 form with the same block_n, block_k, split and chain.

    tokens: pairs a tile (one of TOKENS_SERVED); block_n a multiple of 32 and split times a power
    of two; chain 1 or 4 (moe_mxfp4_gemv.experts_forward)."""
    if tokens not in TOKENS_SERVED:
        raise ValueError(f"gemv_grouped: tokens {tokens} is not one of {TOKENS_SERVED}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_grouped: takes bf16 activations (the fp16x2 form), got {x.dtype}")
    if block_n % 32 or block_n % split or (block_n // split) & (block_n // split - 1) or chain not in (1, 4):
        raise ValueError(f"gemv_grouped: block_n {block_n} must be a multiple of 32 and split {split} times a power "
                         f"of two, chain 1 or 4 (got {chain})")
    t, l = x.shape
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    topk = topk_ids.shape[1]
    order, starts, counts, tile_expert, tile_start = expert_tile_grid(topk_ids, expert_start, e_local, tokens)
    x_planes, x_unscale = half_planes(x)
    act = torch.empty(t * topk, inter, dtype=torch.float16, device=x.device)
    act_unscale = torch.empty(t * topk, inter // 32, dtype=torch.float32, device=x.device)
    act_words = act.view(torch.int32)                                                   # read as pair words
    y = torch.zeros(t * topk, l, dtype=torch.float32, device=x.device)                # other ranks' rows stay 0
    weights = topk_weights.reshape(-1)
    grouping = (tile_expert, tile_start, order, starts, counts)                        # the kernels' order
    form = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SPLIT=split, CHAIN=chain, ASM=not interpreted(),
                TOKENS=tokens, num_warps=num_warps)
    tiles = tile_expert.numel()
    gate_up_kernel[(tiles, triton.cdiv(inter, block_n))](
        x_planes, x_unscale, w13.packed, w13.scales, *grouping, act, act_unscale,      # act: stored as fp16
        x_planes.stride(0), x_unscale.stride(0), *w13.packed.stride()[:2], *w13.scales.stride()[:2],
        act.stride(0), act_unscale.stride(0), topk, float(beta or 1.0), float(linear_beta or 1.0),
        L=l, I=inter, SITU=activation == "situ", HAS_LINEAR_BETA=linear_beta is not None, ROUND_ACT=1, **form,
    )
    down_kernel[(tiles, triton.cdiv(l, block_n))](
        act_words, act_unscale, w2.packed, w2.scales, *grouping, weights, y,
        act_words.stride(0), act_unscale.stride(0), *w2.packed.stride()[:2], *w2.scales.stride()[:2], y.stride(0),
        L=l, I=inter, **form,
    )
    out = torch.empty(t, l, dtype=x.dtype, device=x.device)
    _sum_choices_kernel[(t, triton.cdiv(l, 1024))](y, out, y.stride(0), out.stride(0), TOPK=topk, L=l, BLOCK=1024,
                                                   num_warps=4)
    return out
