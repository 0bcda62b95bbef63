"""The gemv mode's fp16x2 form (moe_mxfp4_gemv.py, HALF): a step of the dot products of a program's
weight rows with one token's activations as packed fp16 pairs (`_half_step_sums`), and the layout the
activations come in: fp16 pair planes, [4, width / 8] int32 words, word j of plane c holding
columns (8j + c, 8j + c + 4) as the code words' nibbles pair them, each 32-column group scaled
by a power of two with an fp32 "unscale" per group (`_half_planes_kernel` builds them from x; the
gate/up kernel writes its activations in the same form for the down kernel)."""

import triton
import triton.language as tl

from .moe_mxfp4_common import e2m1_pairs, e8m0_multiplier, fp16_pair_sum, half_group_scales, hfma2


@triton.jit
def _word_into(w, x0, x1, x2, x3, h, ASM: tl.constexpr):
    """h (fp16 pairs) + the eight products of code word w with its activations: x_c holds
    columns (8j + c, 8j + c + 4) as an fp16 pair, as e2m1_pairs pairs the codes. Four fma.rn.f16x2."""
    p04, p15, p26, p37 = e2m1_pairs(w)
    h = hfma2(p04, x0, h, ASM)
    h = hfma2(p15, x1, h, ASM)
    h = hfma2(p26, x2, h, ASM)
    return hfma2(p37, x3, h, ASM)


@triton.jit
def _split_words(t, SHAPE: tl.constexpr):
    """[..., 4] (a group's four words, in one thread's registers) -> its four [...] slices."""
    a, b = tl.split(tl.reshape(t, SHAPE))                                                     # words (0, 2), (1, 3)
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def _half_step_sums(w, sc, k0, src_ptr, src_unscale_ptr, L: tl.constexpr, G: tl.constexpr, RB: tl.constexpr,
                    SPLIT: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr):
    """One step of moe_mxfp4_gemv's `_rows_dot_token` with HALF: the [RB, G, U] group sums (fp32,
    scaled) of code words w [RB, G, U, 4] (E8M0 codes sc [RB, G, U]) against the activations of
    columns k0..k0 + 32 G, multiplied and summed as fp16x2 (two products an instruction, no
    widening of the codes). src points at the token's int32 pair planes [4, L / 8], plane c word j
    = columns (8j + c, 8j + c + 4) as fp16, each 32-column group scaled by a power of two
    (`half_group_scales`) that src_unscale [L / 32] undoes. The products are exact (code / 2^14
    times a scaled activation: at most 10 significant bits, under 12 in magnitude); the fp16 sums
    round once per add, then go to fp32: per word (CHAIN 1: three adds in fp16 per half) or per
    32-column group (CHAIN 4: fifteen), times the activation group's unscale and the weight
    group's E8M0 scale."""
    PLANE: tl.constexpr = L // 8
    group_in_step = tl.arange(0, G)
    word = k0 // 8 + group_in_step[:, None] * 4 + tl.arange(0, 4)[None, :]                    # [G, 4]
    x0 = tl.load(src_ptr + word)                                                               # [G, 4] fp16 pairs
    x1 = tl.load(src_ptr + PLANE + word)
    x2 = tl.load(src_ptr + 2 * PLANE + word)
    x3 = tl.load(src_ptr + 3 * PLANE + word)
    unscale = tl.load(src_unscale_ptr + k0 // 32 + group_in_step)[None, :, None]               # [1, G, 1]
    if CHAIN == 1:
        h = _word_into(w, x0[None, :, None, :], x1[None, :, None, :], x2[None, :, None, :], x3[None, :, None, :],
                       tl.zeros(w.shape, dtype=tl.int32), ASM)                                # [RB, G, U, 4]
        part = tl.sum(fp16_pair_sum(h, ASM), axis=3)                                          # [RB, G, U]
    else:
        w0, w1, w2, w3 = _split_words(w, (RB, G, SPLIT, 2, 2))                                # [RB, G, U] each
        x00, x01, x02, x03 = _split_words(x0, (G, 2, 2))                                      # [G] each
        x10, x11, x12, x13 = _split_words(x1, (G, 2, 2))
        x20, x21, x22, x23 = _split_words(x2, (G, 2, 2))
        x30, x31, x32, x33 = _split_words(x3, (G, 2, 2))
        h = _word_into(w0, x00[None, :, None], x10[None, :, None], x20[None, :, None], x30[None, :, None],
                       tl.zeros(w0.shape, dtype=tl.int32), ASM)
        h = _word_into(w1, x01[None, :, None], x11[None, :, None], x21[None, :, None], x31[None, :, None], h, ASM)
        h = _word_into(w2, x02[None, :, None], x12[None, :, None], x22[None, :, None], x32[None, :, None], h, ASM)
        h = _word_into(w3, x03[None, :, None], x13[None, :, None], x23[None, :, None], x33[None, :, None], h, ASM)
        part = fp16_pair_sum(h, ASM)                                                          # [RB, G, U]
    return (part * unscale) * e8m0_multiplier(sc.to(tl.int32))                                # two exact steps


@triton.jit
def _pair_plane_index(col, L: tl.constexpr):
    """fp16 index of column col in [4, L / 8] pair planes read as [4, L / 8, 2] fp16: column
    8j + 4h + c at (c, j, h)."""
    return ((col % 4) * (L // 8) + col // 8) * 2 + (col // 4) % 2


@triton.jit
def _half_planes_kernel(x_ptr, out_ptr, unscale_ptr, s_x, s_out, s_un, L: tl.constexpr, GROUPS: tl.constexpr):
    """Token row t (program_id(0)) of x as the gemv's fp16 pair planes and group unscales:
    GROUPS 32-column groups a program (program_id(1))."""
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                                  # [GROUPS]
    col = group[:, None] * 32 + tl.arange(0, 32)[None, :]                                     # [GROUPS, 32]
    mask = col < L
    x = tl.load(x_ptr + t * s_x + col, mask=mask, other=0.0).to(tl.float32)
    scale, unscale = half_group_scales(tl.max(tl.abs(x), axis=1))
    tl.store(out_ptr + t * s_out + _pair_plane_index(col, L), (x * scale[:, None]).to(tl.float16), mask=mask)
    tl.store(unscale_ptr + t * s_un + group, unscale, mask=group < L // 32)
