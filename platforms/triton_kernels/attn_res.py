"""The fused Block AttnRes step in Triton: `AttnResKernels.step` (see k3.reference.attn_res).

One program per token, three passes over the hidden dimension D in chunks:
  1. the new partial sum prefix + delta (rounded to the activation dtype), stored, and written
     into the block bank at `write_index`; the RMS and the query dot product of every visible
     block and of the partial sum accumulate on the way;
  2. the softmax over the sources (blocks, then the partial sum) and their weighted sum, rounded
     to the activation dtype (as the official model rounds the mix before the norm);
  3. with an output norm, K3's RMSNorm of that row (fp32 normalise, cast, times the weight).
The bank row the step writes is never read back from memory in the same launch (another thread
may not have written it yet): where it is also a visible source, the program uses its own copy.
Pass 3 reads the row pass 2 stored, after a barrier. The number of visible blocks and D are
compile-time constants (a model has a handful of values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3 import reference as ref
from k3.plugin.kernels import AttnResOut

_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _partial_sum(prefix_ptr, delta_ptr, t, d, mask_d, s_p, s_d, HAS_DELTA: tl.constexpr):
    """prefix + delta for columns d, rounded to the activation dtype, as fp32."""
    pre = tl.load(prefix_ptr + t * s_p + d, mask=mask_d, other=0.0)
    if HAS_DELTA:
        pre = (pre.to(tl.float32) + tl.load(delta_ptr + t * s_d + d, mask=mask_d, other=0.0).to(tl.float32))
        pre = pre.to(prefix_ptr.dtype.element_ty)
    return pre.to(tl.float32)


@triton.jit
def _sources(blocks_ptr, t, d, mask_d, src, pre, write_index, s_bt, s_bn,
             NVIS: tl.constexpr, HAS_WRITE: tl.constexpr):
    """The visible blocks for columns d as fp32 [S_PAD, BLOCK_D]; the row written this step
    comes from the program's own copy `pre`."""
    if HAS_WRITE:
        fresh = src == write_index
    else:
        fresh = src < 0
    mask = (src < NVIS) & (fresh == 0)
    v = tl.load(blocks_ptr + t * s_bt + src[:, None] * s_bn + d[None, :], mask=mask[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32)
    return tl.where(fresh[:, None], pre[None, :], v)


@triton.jit
def _attn_res_kernel(
    prefix_ptr, delta_ptr, blocks_ptr, query_ptr, norm_w_ptr, h_ptr, prefix_out_ptr,
    s_p, s_d, s_bt, s_bn, s_h, s_po,
    write_index, eps, out_eps,
    D: tl.constexpr, NVIS: tl.constexpr, S_PAD: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_WRITE: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)             # t * row strides can pass 2^31 at long prefill
    act = h_ptr.dtype.element_ty
    src = tl.arange(0, S_PAD)
    sumsq = tl.zeros((S_PAD,), dtype=tl.float32)
    dots = tl.zeros((S_PAD,), dtype=tl.float32)
    pre_sumsq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    pre_dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):                                   # pass 1
        d = d0 + tl.arange(0, BLOCK_D)
        mask_d = d < D
        pre = _partial_sum(prefix_ptr, delta_ptr, t, d, mask_d, s_p, s_d, HAS_DELTA)
        if HAS_DELTA:
            tl.store(prefix_out_ptr + t * s_po + d, pre.to(act), mask=mask_d)
        if HAS_WRITE:
            tl.store(blocks_ptr + t * s_bt + write_index * s_bn + d, pre.to(act), mask=mask_d)
        if NVIS > 0:
            u = tl.load(query_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
            v = _sources(blocks_ptr, t, d, mask_d, src, pre, write_index, s_bt, s_bn, NVIS, HAS_WRITE)
            sumsq += tl.sum(v * v, 1)
            dots += tl.sum(v * u[None, :], 1)
            pre_sumsq += pre * pre
            pre_dot += pre * u
    if NVIS > 0:
        logits = dots * tl.rsqrt(sumsq / D + eps)
        logits = tl.where(src < NVIS, logits, float("-inf"))
        pre_logit = tl.sum(pre_dot, 0) * tl.rsqrt(tl.sum(pre_sumsq, 0) / D + eps)
        top = tl.maximum(tl.max(logits, 0), pre_logit)
        weights = tl.exp(logits - top)
        pre_weight = tl.exp(pre_logit - top)
        total = tl.sum(weights, 0) + pre_weight
        weights = weights / total
        pre_weight = pre_weight / total
    h_sumsq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):                                   # pass 2
        d = d0 + tl.arange(0, BLOCK_D)
        mask_d = d < D
        h = _partial_sum(prefix_ptr, delta_ptr, t, d, mask_d, s_p, s_d, HAS_DELTA)
        if NVIS > 0:
            v = _sources(blocks_ptr, t, d, mask_d, src, h, write_index, s_bt, s_bn, NVIS, HAS_WRITE)
            h = tl.sum(v * weights[:, None], 0) + h * pre_weight
        h = h.to(act).to(tl.float32)
        h_sumsq += h * h
        tl.store(h_ptr + t * s_h + d, h.to(act), mask=mask_d)
    if HAS_NORM:
        tl.debug_barrier()                                            # pass 3 reads what pass 2 stored
        inv = tl.rsqrt(tl.sum(h_sumsq, 0) / D + out_eps)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask_d = d < D
            h = tl.load(h_ptr + t * s_h + d, mask=mask_d, other=0.0).to(tl.float32)
            y = (h * inv).to(act).to(tl.float32)
            w = tl.load(norm_w_ptr + d, mask=mask_d, other=0.0).to(act).to(tl.float32)
            tl.debug_barrier()
            tl.store(h_ptr + t * s_h + d, (y * w).to(act), mask=mask_d)


def covers(prefix, delta, blocks) -> bool:
    """The inputs this kernel computes; anything else goes to the reference op."""
    return (prefix.dtype in _ACTIVATIONS and blocks.dtype == prefix.dtype and prefix.stride(-1) == 1
            and blocks.stride(-1) == 1 and (delta is None or (delta.dtype == prefix.dtype and delta.stride(-1) == 1)))


DECODE_TOKENS = 64


def launch_options(t: int) -> tuple[int, int]:
    """(columns a step, warps) by batch: the H200 at D = 7168 with 8 visible blocks (bench/attn_res.py,
    16 steps a CUDA graph): 4096 on 8 warps for decode batches (9.4 / 10.2 us at T = 1 / 64,
    against 14.6 / 15.6 us for 1024 on 4: one program a token, so the passes' load latency, not
    bandwidth, sets the time, and fewer, wider steps pay it fewer times); 1024 on 4 above (prefill,
    not swept)."""
    return (4096, 8) if t <= DECODE_TOKENS else (1024, 4)


def attn_res(prefix, delta, blocks, *, query, num_visible_blocks, write_index, eps, out_norm_weight, out_eps,
             block_d=None, num_warps=None):
    """`k3.reference.attn_res` as one Triton kernel (same signature and contract).

    block_d (columns a step, a power of two), num_warps: launch options for benchmarks (None:
    `launch_options`)."""
    if not covers(prefix, delta, blocks):
        return ref.attn_res(prefix, delta, blocks, query=query, num_visible_blocks=num_visible_blocks,
                            write_index=write_index, eps=eps, out_norm_weight=out_norm_weight, out_eps=out_eps)
    t, d = prefix.shape
    h = torch.empty_like(prefix)
    prefix_out = torch.empty_like(prefix) if delta is not None else prefix
    if t == 0:
        return AttnResOut(h, prefix_out)
    nvis = int(num_visible_blocks)
    chosen = launch_options(t)
    _attn_res_kernel[(t,)](
        prefix, delta if delta is not None else prefix, blocks, query, out_norm_weight if out_norm_weight is not None
        else query, h, prefix_out,
        prefix.stride(0), delta.stride(0) if delta is not None else 0, blocks.stride(0), blocks.stride(1),
        h.stride(0), prefix_out.stride(0),
        -1 if write_index is None else int(write_index), float(eps), float(out_eps),
        D=d, NVIS=nvis, S_PAD=max(2, triton.next_power_of_2(max(nvis, 1))), HAS_DELTA=delta is not None,
        HAS_WRITE=write_index is not None, HAS_NORM=out_norm_weight is not None,
        BLOCK_D=min(block_d or chosen[0], triton.next_power_of_2(d)), num_warps=num_warps or chosen[1],
    )
    return AttnResOut(h, prefix_out)
