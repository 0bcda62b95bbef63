"""The NVFP4 MLA latent record: one token's `[c | k_pe]` in R/2 + R/16 + Dr bytes.

    record = [ packed c: R/2 uint8 | block scales: R/16 float8_e4m3fn | k_pe: Dr float8_e4m3fn ]

c (kv_lora_rank R values, R % 16 == 0) is NVFP4 (`k3.quant.nvfp4`): E2M1 codes, element 2i in
the low nibble, one E4M3 scale per 16 values, times the layer's fp32 global scale; the rope
dims k_pe are FP8 E4M3 with that same global scale as their per-tensor scale:

    c[i]  = E2M1(code[i]) * float(block_scale[i // 16]) * global_scale
    k_pe  = float(k_pe_e4m3) * global_scale

The global scale is the cache's, fixed before any token is written (a cache cannot rescale its
history); it is not part of the record. These are exactly the bytes `k3.cache.records`
counts per token per MLA layer (352 for K3's R = 512, Dr = 64). Records are token-major, so a
cache page of them is a plain [page, record] byte matrix a slot mapping indexes directly.
"""

from __future__ import annotations

import torch

from .fp8 import fp8_dequantize, fp8_quantize
from .nvfp4 import NVFP4_BLOCK, nvfp4_dequantize, nvfp4_quantize


def nvfp4_latent_record_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one record: R/2 + R/16 + Dr (R % 16 == 0)."""
    if kv_lora_rank % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 latents need kv_lora_rank % 16 == 0, got {kv_lora_rank}")
    return kv_lora_rank // 2 + kv_lora_rank // NVFP4_BLOCK + rope_dim


def split_nvfp4_latent(records: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of records uint8 [..., R/2 + R/16 + Dr]: (packed uint8 [..., R/2], block scales
    float8_e4m3fn [..., R/16], k_pe float8_e4m3fn [..., Dr]). No copy: writing them writes the
    records."""
    if records.dtype != torch.uint8 or records.dim() == 0:
        raise ValueError(f"nvfp4 latent records must be uint8 [..., record], got {records.dtype} "
                         f"{tuple(records.shape)}")
    half, nscale = kv_lora_rank // 2, kv_lora_rank // NVFP4_BLOCK
    if records.shape[-1] <= half + nscale:
        raise ValueError(f"nvfp4 latent records of {records.shape[-1]} bytes cannot hold R = {kv_lora_rank} "
                         f"({half + nscale} bytes) and rope dims")
    packed = records[..., :half]
    scales = records[..., half: half + nscale].view(torch.float8_e4m3fn)
    rope = records[..., half + nscale:].view(torch.float8_e4m3fn)
    return packed, scales, rope


def nvfp4_latent_quantize(rows: torch.Tensor, *, kv_lora_rank: int, global_scale: torch.Tensor | float,
                          quant=None) -> torch.Tensor:
    """Latent rows [..., R + Dr] (any float dtype) -> records uint8 [..., R/2 + R/16 + Dr].

    `quant`: a table with `nvfp4_quantize` and `fp8_quantize` (a platform's `k3.plugin.tables.QuantKernels`);
    None uses `k3.quant`'s own codecs. Rounding is theirs: E2M1 round-half-to-even with E4M3 block
    scales amax / (6 * global_scale), k_pe / global_scale rounded to E4M3, saturating.
    """
    r = kv_lora_rank
    if not rows.is_floating_point() or rows.dim() == 0 or rows.shape[-1] <= r:
        raise ValueError(f"nvfp4_latent_quantize: rows must be float [..., R={r} + Dr], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    nv = nvfp4_quantize if quant is None else quant.nvfp4_quantize
    f8 = fp8_quantize if quant is None else quant.fp8_quantize
    flat = rows.reshape(-1, rows.shape[-1])
    packed, block_scales, _ = nv(flat[:, :r], global_scale=global_scale)
    rope = f8(flat[:, r:], scale=global_scale, dtype=torch.float8_e4m3fn)[0]
    out = torch.cat([packed, block_scales.view(torch.uint8), rope.view(torch.uint8)], -1)
    return out.reshape(*rows.shape[:-1], out.shape[-1])


def nvfp4_latent_dequantize(records: torch.Tensor, *, kv_lora_rank: int, global_scale: torch.Tensor | float,
                            dtype: torch.dtype = torch.float32, quant=None) -> torch.Tensor:
    """Records uint8 [..., R/2 + R/16 + Dr] -> latent rows [..., R + Dr] in `dtype` (computed
    in fp32, fp64 for float64; exact in bf16 and wider: E2M1 x E4M3 has at most 6 significant
    bits). `quant` as in `nvfp4_latent_quantize`. Poisoned (0xFF) bytes decode to NaN."""
    nv = nvfp4_dequantize if quant is None else quant.nvfp4_dequantize
    f8 = fp8_dequantize if quant is None else quant.fp8_dequantize
    packed, scales, rope = split_nvfp4_latent(records, kv_lora_rank)
    lead = records.shape[:-1]
    c = nv(packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, scales.shape[-1]), global_scale, dtype=dtype)
    pe = f8(rope.reshape(-1, rope.shape[-1]), global_scale, dtype=dtype)
    return torch.cat([c, pe], -1).reshape(*lead, kv_lora_rank + rope.shape[-1])
