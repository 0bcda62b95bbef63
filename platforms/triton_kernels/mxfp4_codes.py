"""Decoding MXFP4's E2M1 codes inside Triton kernels (shared by the routed-experts modes)."""

import triton
import triton.language as tl


@triton.jit
def e2m1_over_16384(code):
    """E2M1 nibble (int32, 0..15) -> fp32 value / 2^14: placed as an fp16's sign, two lowest
    exponent bits and top mantissa bit (code 1, 0.5, lands on an fp16 subnormal, which the
    conversion keeps exactly)."""
    bits = ((code << 9) & 0x0E00) | ((code << 12) & 0x8000)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
