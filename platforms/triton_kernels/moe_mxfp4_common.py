"""Pieces the MXFP4 routed-expert kernels share (moe_mxfp4.py's tensor-core and byte-decode
modes, moe_mxfp4_gemv.py, moe_mxfp4_dequant.py): in the kernels, fp16 bit patterns widened to
fp32, E2M1 and E8M0 decoding, and the gated activation of the gate/up projection (which glu.py,
the dense FFNs' activation, shares so dense and routed experts compute the same function); on
the host side, the grouping of (token, choice) pairs by local expert."""

import torch
import triton
import triton.language as tl


def pairs_by_local_expert(topk_ids: torch.Tensor, expert_start: int, e_local: int):
    """The T*k (token, choice) pairs' local experts, ids of other ranks in bucket e_local
    ([T*k] int64), and the pairs sorted by it (stable argsort, [T*k] int64). On the device,
    no host synchronisation."""
    local = topk_ids.reshape(-1).long() - expert_start
    local = local.masked_fill((local < 0) | (local >= e_local), e_local)
    return local, torch.argsort(local, stable=True)


def pairs_per_local_expert(local: torch.Tensor, e_local: int) -> torch.Tensor:
    """How many pairs each local expert got, other ranks' in bucket e_local ([E_local + 1]
    int32), from `pairs_by_local_expert`'s `local`. A scatter-add on the device: torch.bincount
    would read its maximum on the host (a synchronisation, and no CUDA-graph capture)."""
    counts = torch.zeros(e_local + 1, dtype=torch.int32, device=local.device)
    return counts.scatter_add_(0, local, torch.ones_like(local, dtype=torch.int32))


def expert_tiles(counts: torch.Tensor, block_t: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's token tiles: for each tile, its expert and the offset of its first (token,
    choice) pair among that expert's; counts [E] pairs per expert (on the device), `pairs` their
    total bound (T * k). Each expert with pairs gets ceil(count / block_t) consecutive tiles, so a
    weight tile is read by neighbouring programs; the grid is sized for the worst case
    (ceil(pairs / block_t) + min(E, pairs) tiles: at most one part-filled tile per expert) and
    the tiles past the last are given expert E (count 0: the program returns at once). Built on
    the device without a host synchronisation (CUDA-graph capturable).
    Returns (tile_expert, tile_start), int32 [num_tiles]."""
    e = counts.numel()
    num_tiles = triton.cdiv(pairs, block_t) + min(e, pairs)
    blocks = (counts.long() + block_t - 1) // block_t                                   # [E]
    ends = torch.cumsum(blocks, 0)                                                      # [E]
    tile = torch.arange(num_tiles, device=counts.device)
    tile_expert = torch.searchsorted(ends, tile, right=True)                            # E past the last tile
    first = (ends - blocks).gather(0, tile_expert.clamp(max=e - 1))
    tile_start = ((tile - first) * block_t).masked_fill(tile_expert == e, 0)
    return tile_expert.to(torch.int32), tile_start.to(torch.int32)


def expert_tile_grid(topk_ids: torch.Tensor, expert_start: int, e_local: int, block_t: int):
    """The device-side grouping both tiled modes launch on: the T*k (token, choice) pairs sorted
    by local expert (ids of other ranks in bucket e_local, which no tile reads), and the tiles of
    up to block_t pairs of one expert (`expert_tiles`). No host round trip, so a CUDA graph can
    capture it. Returns (order [T*k], starts [E_local + 1], counts [E_local + 1], tile_expert,
    tile_start), int32."""
    local, order = pairs_by_local_expert(topk_ids, expert_start, e_local)
    counts = pairs_per_local_expert(local, e_local)                                     # [E_local + 1]
    counts[e_local:].zero_()                              # other ranks' choices: no tile reads them (no H2D copy)
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    tile_expert, tile_start = expert_tiles(counts[:e_local], block_t, topk_ids.numel())
    return order.to(torch.int32), starts, counts, tile_expert, tile_start


@triton.jit
def fp16_bits_to_f32(bits):
    """Low 16 bits of an integer tensor as an fp16, widened to fp32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_over_16384(code):
    """E2M1 nibble (int32, 0..15) -> fp32 value / 2^14: placed as an fp16's sign, two lowest
    exponent bits and top mantissa bit (code 1, 0.5, lands on an fp16 subnormal, which the
    conversion keeps exactly)."""
    return fp16_bits_to_f32(((code << 9) & 0x0E00) | ((code << 12) & 0x8000))


# Two bytes of packed codes -> their four values as bf16, times the elements' bf16 multipliers:
# outputs $0 the low nibbles (elements 0 1 in the low / high half), $1 the high nibbles; inputs $2
# the two bytes (low 16 bits), $3 the multipliers (elements 0 1). prmt spreads bytes 0 1 into the
# two 16-bit halves of a register; a nibble's magnitude bits shifted to bits 8..6 and its sign to
# bit 15 of its half (lop3 (a | b) & c, LUT 0xA8) is a bf16 of value / 2^126; fma.rn.bf16x2 with a
# -0 addend multiplies exactly by 2^126 (0x7E80) and then by the multiplier (a power of two).
# Two elements an instance because the bf16 tensor-core operand layout gives each thread pairs of
# neighbouring columns (bytes j, j + 1: one 16-bit shared-memory load); three instructions a
# weight. GPU only (the interpreter runs no PTX).
E2M1_BF16X2_PTX = tl.constexpr("""{
.reg .b32 x, a, b, z, two126, mz;
mov.b32 two126, 0x7E807E80;
mov.b32 mz, 0x80008000;
prmt.b32 x, $2, 0, 0x4140;
shl.b32 a, x, 6;
shl.b32 b, x, 12;
lop3.b32 a, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 a, a, two126, mz;
fma.rn.bf16x2 $0, a, $3, mz;
and.b32 z, x, 0x00F000F0;
shl.b32 a, z, 2;
shl.b32 b, z, 8;
lop3.b32 a, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 a, a, two126, mz;
fma.rn.bf16x2 $1, a, $3, mz;
}""")


# E2M1_BF16X2_PTX with the 2^126 folded into the multiplier ($3 = 2^(scale - 1), one fma a pair):
# only for E8M0 scale codes up to 128, where 2^(code - 1) is a bf16 (`e2m1_bf16_pairs`' FOLD).
E2M1_BF16X2_FOLDED_PTX = tl.constexpr("""{
.reg .b32 x, a, b, z, mz;
mov.b32 mz, 0x80008000;
prmt.b32 x, $2, 0, 0x4140;
shl.b32 a, x, 6;
shl.b32 b, x, 12;
lop3.b32 a, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $0, a, $3, mz;
and.b32 z, x, 0x00F000F0;
shl.b32 a, z, 2;
shl.b32 b, z, 8;
lop3.b32 a, a, b, 0x81C081C0, 0xA8;
fma.rn.bf16x2 $1, a, $3, mz;
}""")


@triton.jit
def tile_major_row(row, K: tl.constexpr):
    """Where weight row `row` (a scalar or a tensor) of a K-column expert lies in the tile-major
    layout (`k3.quant.mxfp4_tiles`: tiles of 128 rows x 64 columns, row tile by row tile, each
    row tile's K / 64 column tiles in turn), counted in tile rows (32 code bytes, 2 scale bytes):
    the row's first byte in its first column tile is this times 32 (scales: times 2)."""
    return (row // 128) * (128 * (K // 64)) + row % 128


@triton.jit
def e2m1_bf16_pairs(packed, scale_codes, FOLD: tl.constexpr = False):
    """MXFP4 codes as bf16 by PTX (NVIDIA GPUs; the interpreter runs no PTX), exact (every MXFP4
    value is a bf16; products past bf16's range are inf, as in fp32): packed uint8 codes
    [R, G, 16] (G groups of 32 elements) and their E8M0 scale codes [R, G] (int32) -> (low
    nibbles, high nibbles), bf16 [R, G, 16]. E2M1_BF16X2_PTX, or FOLD: E2M1_BF16X2_FOLDED_PTX
    (2^(code - 1) by bit placement: scale codes up to 128 only)."""
    if FOLD:
        folded = ((scale_codes + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        multiplier = tl.broadcast_to(folded[:, :, None], packed.shape)
        return tl.inline_asm_elementwise(E2M1_BF16X2_FOLDED_PTX, "=r,=r,r,r", [packed, multiplier],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    multiplier = tl.broadcast_to(e8m0_bf16(scale_codes)[:, :, None], packed.shape)
    return tl.inline_asm_elementwise(E2M1_BF16X2_PTX, "=r,=r,r,r", [packed, multiplier],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def e8m0_bf16(code):
    """E8M0 scale codes (an integer tensor) -> 2^(code - 127) as bf16 (code 0 is the subnormal
    2^-127, code 255 NaN), by bit placement."""
    bits = tl.where(code == 0, 0x0040, tl.where(code == 255, 0x7FC0, code << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_multiplier(code):
    """E8M0 scale code (int32) -> 2^(code - 127) in fp32; code 255 is NaN."""
    return tl.where(code == 255, float("nan"), tl.exp2((tl.minimum(code, 254) - 127).to(tl.float32)))


@triton.jit
def gated_activation(g, u, beta, linear_beta, SITU: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    """SiTU-GLU act(g) * u in fp32 (beta tanh(g / beta) sigmoid(g), u through linear_beta
    tanh(u / linear_beta) when given), or SiLU-GLU g sigmoid(g) * u."""
    if SITU:
        act = beta * (2.0 * tl.sigmoid(2.0 * g / beta) - 1.0) * tl.sigmoid(g)                # beta tanh(g/beta) sig(g)
        if HAS_LINEAR_BETA:
            u = linear_beta * (2.0 * tl.sigmoid(2.0 * u / linear_beta) - 1.0)
    else:
        act = g * tl.sigmoid(g)
    return act * u


@triton.jit
def fp16_pair_bits(lo, hi):
    """Two fp32 tensors rounded to fp16 (nearest even) and packed as one int32 (lo in bits 0-15)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (hi16 << 16) | lo16


@triton.jit
def hfma2(a, b, c, ASM: tl.constexpr):
    """a * b + c on int32 registers that hold two fp16 each (both halves at once): one
    `fma.rn.f16x2` on the GPU. Without inline assembly (ASM False: the Triton interpreter), the
    same in fp32 rounded to fp16 per half: where the product is exact in fp16 (an E2M1 code times
    an fp16 activation holds at most 10 significant bits) both are one rounding of the sum."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        lo = fp16_bits_to_f32(a) * fp16_bits_to_f32(b) + fp16_bits_to_f32(c)
        hi = fp16_bits_to_f32(a >> 16) * fp16_bits_to_f32(b >> 16) + fp16_bits_to_f32(c >> 16)
        return fp16_pair_bits(lo, hi)


@triton.jit
def fp16_pair_sum(a, ASM: tl.constexpr):
    """The two fp16 halves of int32 a widened to fp32 and added (two conversions and an add)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 lo, hi; .reg .f32 t; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, lo; cvt.f32.f16 t, hi; "
            "add.f32 $0, $0, t; }", "=r,r", [a], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return fp16_bits_to_f32(a) + fp16_bits_to_f32(a >> 16)


@triton.jit
def e2m1_pairs(w):
    """A uint32 word of eight E2M1 codes (code c in bits 4c..4c+3) as four fp16 pairs (int32), pair
    c holding codes c (low half) and c + 4 (high half): each code placed as an fp16's sign, two
    lowest exponent bits and top mantissa bit, which is its value / 2^14 (code 1, 0.5, lands on
    an fp16 subnormal)."""
    p04 = ((w << 9) & 0x0E000E00) | ((w << 12) & 0x80008000)
    p15 = ((w << 5) & 0x0E000E00) | ((w << 8) & 0x80008000)
    p26 = ((w << 1) & 0x0E000E00) | ((w << 4) & 0x80008000)
    p37 = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    return p04, p15, p26, p37


@triton.jit
def half_group_scales(amax):
    """Per group of activations, from its largest magnitude (fp32): (scale, unscale), powers of
    two with unscale = 2^floor(log2 amax) and scale = 2^14 / unscale, so amax * scale lies in
    [2^14, 2^15): fp16 holds every scaled value of a bf16 group exactly (bf16's 8 significant
    bits, down to 2^-32 of amax), and an E2M1 code / 2^14 times one stays under 12. A zero or
    tiny group gets unscale 2^-100 (no division by zero); a non-finite one scale 0 (NaN out)."""
    unscale = (amax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    unscale = tl.maximum(unscale, 7.888609052210118e-31)                                     # 2^-100
    return 16384.0 / unscale, unscale
