"""Where the Triton kernels round a 16-bit model's intermediates, one rule for every variant of
an entry (docs/batch-invariance.md, "Rounding points"): a token's result may depend on its batch
company only through fp32 accumulation order, never through a variant that rounds elsewhere.

`round_code(dtype)` is the constexpr the kernels take (0: keep fp32; 1: bf16; 2: fp16) and
`round_to` applies it in a kernel. `legacy()` (`k3.dtypes.legacy_rounding`, K3_LEGACY_ROUNDING=1)
restores the kernels' variants as they rounded before issue 32 (the MoE gemv's fp16x2 group sums,
the MoE modes without the gate/up and down roundings, the MLA decode's split-relative softmax
rounding), so one device run can measure the engine-level figure before and after
(bench/bf16_batch_company.py). It exists for that measurement only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.dtypes import legacy_rounding as legacy  # noqa: F401  (rounding.legacy)


def round_code(dtype: torch.dtype) -> int:
    """The kernels' ROUND constexpr for a model of `dtype`: 1 for bf16, 2 for fp16, 0 otherwise."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """fp32 x rounded to the model's 16-bit dtype and widened back (ROUND 1: bf16, 2: fp16, 0: x)."""
    if ROUND == 1:
        return x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
