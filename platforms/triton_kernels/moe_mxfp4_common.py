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
