"""`moe.experts` on AMD: the portable MXFP4 expert kernel (k3.platforms.triton_kernels.moe_mxfp4)
with the mode chosen per batch for the target (archs.py), since its default choice (the `gemv`
mode for decode batches) is inline PTX that AMD cannot run."""

from __future__ import annotations

import torch

from k3.platforms.triton_kernels import interpreted

# moe_mxfp4 (Triton) is imported where a kernel runs, so this module, like every plugin module
# outside k3.platforms.triton_kernels, imports where Triton is not installed.


def choose_mode(x: torch.Tensor, prefer: str) -> str:
    """The mode for activations x: `prefer` (the target's: "dot_scaled" where the matrix cores
    take MXFP4, gfx950; "decode" elsewhere) for bf16 batches on the device below
    moe_mxfp4.DEQUANT_MIN_TOKENS, "dequant" from there (prefill chunks), "decode" for fp32 / fp16
    activations and under the Triton interpreter (which has no dot_scaled)."""
    if x.dtype != torch.bfloat16 or not x.is_cuda or interpreted():
        return "decode"
    from k3.platforms.triton_kernels import moe_mxfp4
    return "dequant" if x.shape[0] >= moe_mxfp4.DEQUANT_MIN_TOKENS else prefer


def experts_forward(x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None, expert_start=0,
                    dense_dispatch=False, prefer="decode", tf32=True):
    """`k3.reference.experts_forward` over MXFP4 experts (same signature and contract).

    prefer, tf32: the target's launch options (archs.py): the bf16 decode-batch mode, and whether
    tf32 dots exist (False: IEEE fp32 products where the kernel would use tf32)."""
    from k3.platforms.triton_kernels import moe_mxfp4
    return moe_mxfp4.experts_forward(x, w13, w2, topk_weights, topk_ids, activation=activation, beta=beta,
                                     linear_beta=linear_beta, expert_start=expert_start,
                                     dense_dispatch=dense_dispatch, mode=choose_mode(x, prefer),
                                     ieee=None if tf32 else True)
