"""How fast the MoE tiles can stream k3-slice's MXFP4 expert weights, by access pattern alone
(issue 27: the decode_bf16 tiles reach 43-45% of the bytes floor at 16-64 tokens).

    python3 bench/moe_weight_stream.py [--out moe_weight_stream.json]          # on the GPU

Every launch reads all 128 experts' gate/up codes (k3-slice: 128 x 6,144 rows x 1,792 bytes,
1.41 GB, far past L2) the way a tile program does: a program owns 128 gate rows and the 128 up
rows I further on, and steps along the row, turning each step's bytes into bf16 and multiplying
them on the tensor cores by a [columns, 16] matrix (so Triton pipelines the loads with cp.async
as it does in the served tiles); what it computes is a checksum, compared with torch's. Patterns:

  rows_kB     the stored layout ([E, rows, K/2] bytes): each step reads B/2 bytes of each of
              256 rows 1,792 bytes apart (B = 64 is the served tiles' step: 32-byte pieces);
  tiled_kB    the same bytes laid out tile by tile (each step's 128 rows x B/2 bytes contiguous,
              the steps of a tile one after another): what a load-time repacking would give;
  rows_kB_sc  rows_kB plus the tiles' per-step E8M0 scale loads as the served kernel issues them
              (a byte per row and group), which multiply the decoded values.

Each figure is GB/s over the measured device-to-device copy bandwidth (the bytes floor).
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from measure import bench_ms, run_header, save

E, I, L = 128, 3072, 3584


@triton.jit
def _stream_kernel(codes_ptr, scales_ptr, out_ptr, ROW_BYTES: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr,
                   STEP: tl.constexpr, TILED: tl.constexpr, SCALES: tl.constexpr,
                   OPERAND: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    expert = codes_ptr + e * (2 * I * ROW_BYTES)
    rows = n * BLOCK_N + tl.arange(0, BLOCK_N)
    ones = tl.full((STEP, 16), 1.0, OPERAND)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    for b0 in range(0, ROW_BYTES, STEP):
        for half in tl.static_range(2):                 # the gate rows, then the up rows I further on
            if TILED:   # tile (half, n): ROW_BYTES / STEP steps of [BLOCK_N, STEP] bytes, contiguous
                tile = expert + (half * I + n * BLOCK_N) * ROW_BYTES
                ptr = tile + b0 * BLOCK_N + tl.arange(0, BLOCK_N)[:, None] * STEP + tl.arange(0, STEP)[None, :]
            else:
                ptr = expert + (half * I + rows)[:, None] * ROW_BYTES + b0 + tl.arange(0, STEP)[None, :]
            values = tl.load(ptr).to(OPERAND)
            if SCALES:  # a scale byte per row and 16 code bytes (32 values), loaded as the served tile does
                sc = tl.load(scales_ptr + e * (2 * I * ROW_BYTES // 16) + (half * I + rows)[:, None] * (ROW_BYTES // 16)
                             + b0 // 16 + tl.arange(0, STEP // 16)[None, :])
                mult = (sc.to(tl.int32) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True).to(OPERAND)  # 2^(code-127)
                values = tl.reshape(tl.reshape(values, (BLOCK_N, STEP // 16, 16)) * mult[:, :, None],
                                    (BLOCK_N, STEP))
            acc = tl.dot(values, ones, acc)
    tl.store(out_ptr + e * tl.num_programs(1) + n, tl.sum(tl.sum(acc, 1), 0) / 16)   # exact: < 2^24


PATTERNS = {f"{kind}_k{2 * step}{'_sc' if sc else ''}": (step, kind == "tiled", sc)
            for kind, step, sc in (("rows", 32, False), ("rows", 64, False), ("rows", 128, False),
                                   ("tiled", 32, False), ("tiled", 64, False), ("rows", 32, True))}


def stream(codes, scales, step, tiled, with_scales, block_n=128, warps=8, stages=3):
    """codes [E, 2I, K/2] uint8 (scales [E, 2I, K/32]) through `_stream_kernel`: [E, I / block_n]
    checksums, one a program (poisoned with NaN first)."""
    e, two_i, row_bytes = codes.shape
    out = torch.full((e, two_i // 2 // block_n), float("nan"), device=codes.device, dtype=torch.float32)
    _stream_kernel[out.shape](codes, scales, out, ROW_BYTES=row_bytes, I=two_i // 2, BLOCK_N=block_n, STEP=step,
                              TILED=tiled, SCALES=with_scales, num_warps=warps, num_stages=stages,
                              OPERAND=tl.bfloat16 if codes.is_cuda else tl.float16)  # the interpreter's bf16 dot is not exact
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_weight_stream.json")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter: the checksums at tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        codes = torch.randint(0, 4, (2, 2 * 128, 128), dtype=torch.uint8)
        scales = torch.full((2, 2 * 128, 8), 127, dtype=torch.uint8)
        for name, (step, tiled, with_scales) in PATTERNS.items():
            got = stream(codes, scales, step, tiled, with_scales).double().sum().item()
            assert got == codes.double().sum().item(), (name, got)
        print("smoke: every pattern's checksum matches")
        return 0
    result = run_header(f"E{E} gate/up rows 2x{I}, {L // 2} bytes a row (k3-slice MXFP4 codes)")
    codes = torch.randint(0, 4, (E, 2 * I, L // 2), dtype=torch.uint8, device="cuda")   # small: exact fp32 sums
    scales = torch.full((E, 2 * I, L // 32), 127, dtype=torch.uint8, device="cuda")        # 2^0
    want = codes.sum(dtype=torch.float64).item()
    nbytes = codes.numel()
    failed = False
    for name, (step, tiled, with_scales) in PATTERNS.items():
        got = stream(codes, scales, step, tiled, with_scales).double().sum().item()
        ms = bench_ms(lambda: stream(codes, scales, step, tiled, with_scales))
        gbps = (nbytes + (scales.numel() if with_scales else 0)) / ms / 1e6
        result[name] = {"us": ms * 1e3, "GBps": gbps, "fraction_of_copy": gbps / result["copy_GBps"],
                        "checksum_ok": got == want}
        failed |= got != want
        print(f"{name:<14} {ms * 1e3:7.0f} us  {gbps:6.0f} GB/s  {100 * gbps / result['copy_GBps']:5.1f}% of copy"
              f"  checksum {'ok' if got == want else f'WRONG {got} vs {want}'}", flush=True)
    save(result, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
