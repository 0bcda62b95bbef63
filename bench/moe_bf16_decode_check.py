"""The decode_bf16 MoE mode's in-kernel MXFP4 decode, bit for bit, on the GPU (issue 27).

    python3 bench/moe_bf16_decode_check.py [--out moe_bf16_decode_check.json]

Its forms (the PTX on bf16 pairs, which only a GPU runs; the same with the 2^126 bias folded into
the scale, for scale codes up to 128, where only those are compared; and the fp32 bit placement
that the Triton-interpreter tier checks on the CPU) decode all 256 code bytes under E8M0 scale codes
from 0 (2^-127, a bf16 subnormal) to 254 and 255 (NaN), with the row layout the served tiles
load; each value must equal `MXFP4Tensor.dequantize` rounded to bf16 bit for bit (NaN as NaN),
outputs poisoned with NaN first. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from k3.platforms.triton_kernels import moe_mxfp4
from k3.quant.mxfp4 import MXFP4Tensor
from measure import run_header, save


@triton.jit
def _decode_rows(packed_ptr, scales_ptr, lo_ptr, hi_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr, FOLD: tl.constexpr):
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    mask = rows < ROWS
    k0 = tl.program_id(1) * BLOCK_K
    sc = moe_mxfp4._scale_codes(scales_ptr, rows, mask, k0, COLS // 32, BLOCK_K // 32)
    lo, hi = moe_mxfp4._decoded_rows_bf16(packed_ptr, sc, rows, mask, k0, COLS // 2, BLOCK_K, ASM, FOLD)
    out = rows[:, None] * (COLS // 2) + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
    tl.store(lo_ptr + out, lo, mask=mask[:, None])
    tl.store(hi_ptr + out, hi, mask=mask[:, None])


def codes(device) -> tuple[torch.Tensor, torch.Tensor]:
    """[256 rows, 512 columns] of MXFP4: row r holds every byte 0..255 once, each of its 16 groups
    a scale code; the 256 rows together take every scale code 0..255 in every group position."""
    rows, cols = 256, 512
    packed = torch.arange(256, dtype=torch.int32).repeat(rows, 1)
    packed = torch.stack([p.roll(r) for r, p in enumerate(packed)]).to(torch.uint8)    # bytes move across groups
    scales = ((torch.arange(rows)[:, None] + 17 * torch.arange(cols // 32)[None, :]) % 256).to(torch.uint8)
    return packed.to(device), scales.to(device)


def decoded(packed: torch.Tensor, scales: torch.Tensor, block_k: int, asm: bool, fold: bool) -> torch.Tensor:
    """`codes`' [256, 512] values through `_decode_rows` (outputs poisoned with NaN first), bf16."""
    lo = torch.full((256, 256), float("nan"), dtype=torch.bfloat16, device=packed.device)
    hi = torch.full_like(lo, float("nan"))
    _decode_rows[(16, 512 // block_k)](packed, scales, lo, hi, ROWS=256, COLS=512, BLOCK_K=block_k, ASM=asm,
                                       FOLD=fold, num_warps=4)
    return torch.stack([lo, hi], -1).reshape(256, 512)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where got and want hold the same bf16 bits, NaN counting as NaN."""
    return (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_bf16_decode_check.json")
    args = parser.parse_args()
    result = run_header("MXFP4 decode to bf16: 256 bytes x 256 scale codes")
    packed, scales = codes("cuda")
    want = MXFP4Tensor(packed, scales).dequantize(torch.float32).to(torch.bfloat16)
    failed = False
    folded_ok = (scales.repeat_interleave(32, -1) <= 128)                               # [256, 512]
    for form, asm, fold in (("ptx", True, False), ("bits", False, False), ("folded", True, True)):
        for block_k in (64, 128, 256):
            got = decoded(packed, scales, block_k, asm, fold)
            same = same_bits(got, want)
            if fold:                                      # the folded form serves scale codes <= 128 only
                same |= ~folded_ok
            key = f"{form}_k{block_k}"
            result[key] = {"values": same.numel(), "different": int((~same).sum()), "inf": int(got.isinf().sum()),
                           "nan": int(got.isnan().sum()), "zero": int((got == 0).sum())}
            print(key, result[key], flush=True)
            failed |= not bool(same.all())
    result["passed"] = not failed
    save(result, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
