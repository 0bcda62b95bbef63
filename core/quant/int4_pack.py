"""W4A16: int4 weights in groups sharing one scale, as compressed-tensors `pack-quantized` stores them.

Per Linear `[out, in]` (symmetric int4, `num_bits: 4`, `type: int`, `strategy: group`):
- `weight_packed` int32 `[out, in/8]`: eight 4-bit values a word, column 8c + j in bits
  4j .. 4j+3 (j = 0 the least significant), each stored as q + 8 (offset binary, 0..15), so
  q = nibble - 8 lies in [-8, 7];
- `weight_scale` float (the model's dtype) `[out, in/group_size]`;
- `weight_shape` int64 `[2]` = `[out, in]` (the library unpacks to it; no padding when 8
  divides `in`).
`W[o, i] = q[o, i] * scale[o, i // group_size]`. Asymmetric files also carry a packed
`weight_zero_point`; k3 reads symmetric ones only.

The library's quantiser (`calculate_qparams` + `quantize`): scale = amax / 7.5 of each group
(amax = max |w|, at least 0; a zero scale becomes the scale dtype's eps), q = clamp(round(w /
scale), -8, 7), rounding half to even, so the group's largest magnitude lands on +-7.5 and
rounds to -8 or saturates at 7. `int4_quantize` follows that rule, in the weight's dtype.
"""

from __future__ import annotations

import torch

INT4_PER_WORD = 8
INT4_OFFSET = 8   # stored nibble = q + 8
INT4_QMIN, INT4_QMAX = -8, 7


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] [..., N] (N % 8 == 0, any integer dtype) -> int32 [..., N/8]."""
    if q.is_floating_point() or q.dim() == 0 or q.shape[-1] % INT4_PER_WORD:
        raise ValueError(f"pack_int4: q must be an integer tensor [..., N] with N % 8 == 0, "
                         f"got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < INT4_QMIN or int(q.max()) > INT4_QMAX):
        raise ValueError(f"pack_int4: values must lie in [-8, 7], got {int(q.min())}..{int(q.max())}")
    nibbles = (q.to(torch.int64) + INT4_OFFSET).reshape(*q.shape[:-1], q.shape[-1] // INT4_PER_WORD,
                                                         INT4_PER_WORD)      # [..., N/8, 8]
    shifts = torch.arange(INT4_PER_WORD, device=q.device, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(-1)                                      # [..., N/8] in 0 .. 2^32-1
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> int8 q [..., 8M] in [-8, 7] (the inverse of `pack_int4`)."""
    if packed.dtype != torch.int32 or packed.dim() == 0:
        raise ValueError(f"unpack_int4: packed must be int32 [..., M], got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(INT4_PER_WORD, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                         # [..., M, 8] (>> is arithmetic)
    return (nibbles - INT4_OFFSET).to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] * INT4_PER_WORD)


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W4A16 -> dense: packed int32 [..., N/8], scales float [..., N/group] -> `dtype` [..., N].

    q * scale is computed in fp32 (float64 when dtype is float64; exact: a 4-bit integer times
    a bf16 / fp16 scale fits fp32), then cast to `dtype` (one rounding, as the library's own
    decompressor in the scale's dtype gives for bf16 / fp16 scales)."""
    if not scales.is_floating_point():
        raise ValueError(f"int4_dequantize: scales must be a float tensor, got {scales.dtype}")
    n = packed.shape[-1] * INT4_PER_WORD if packed.dim() else 0
    groups = scales.shape[-1] if scales.dim() else 0
    if packed.dim() == 0 or scales.shape[:-1] != packed.shape[:-1] or not groups or n % groups:
        raise ValueError("int4_dequantize: expected packed [..., N/8] and scales [..., N/group] with the group "
                         f"dividing N, got packed {tuple(packed.shape)} and scales {tuple(scales.shape)}")
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack_int4(packed).to(cd).reshape(*scales.shape, n // groups)       # [..., N/g, g]
    return (q * scales.to(cd).unsqueeze(-1)).reshape(*packed.shape[:-1], n).to(dtype)


def int4_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., N] (N divisible by group_size and by 8) with the library's symmetric
    W4A16 rule (module docstring), in w's own dtype as the library computes it: the scale is
    amax / 7.5 rounded to w's dtype, and w / scale is rounded to w's dtype before it is rounded
    to an integer. Returns (packed int32 [..., N/8], scales [..., N/group] of w's dtype)."""
    if not w.is_floating_point() or w.dim() == 0 or w.shape[-1] % group_size or w.shape[-1] % INT4_PER_WORD:
        raise ValueError(f"int4_quantize: w must be a float tensor [..., N] with N divisible by {group_size} "
                         f"and by 8, got {w.dtype} {tuple(w.shape)}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)             # [..., N/g, g]
    scales = g.abs().amax(-1) / 7.5                                                  # [..., N/g], w's dtype
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scales)
    q = torch.round((g / scales.unsqueeze(-1)).clamp(INT4_QMIN, INT4_QMAX))          # half to even
    return pack_int4(q.to(torch.int8).reshape(w.shape)), scales
