"""Products on bf16 operands that do not round their fp32 left operand: the hi / lo split.

The torch-native experts (`moe_w4a16`) multiply bf16 weights (MXFP4 dequantised, exact in bf16,
or the expert cache's bf16 stacks) because the bytes read are the bound, but their down product
takes the GLU's fp32 output. Rounding it to bf16 as well as the gate/up and down products' outputs
puts three bf16 rounding points in a row, which measurably flips greedy tokens of the bf16 tiny
models against the float64 oracle (model.greedy, k3.1-pro-tiny); two (gate/up and down outputs)
do not. So the activation goes in as two bf16 rows:

    a = hi + lo + r,   hi = bf16(a),  lo = bf16(a - hi),  |r| <= 2^-16 |a|
    a W^T ~= hi W^T + lo W^T           (each product accumulated in fp32, output rounded to bf16;
                                        the lo product is 2^-8 of the hi one, so its rounding is
                                        below fp32-order noise)

Both rows of a group go through one product (rows doubled, the weights read once): for grouped
rows, group e's hi rows then its lo rows, so the group offsets simply double.
"""

from __future__ import annotations

import torch


def split_bf16(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) bf16 with hi + lo = a to within 2^-16 relative (module docstring)."""
    hi = a.to(torch.bfloat16)
    return hi, (a - hi.to(a.dtype)).to(torch.bfloat16)


def interleave_groups(a: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [M, K] fp32 whose rows come in consecutive groups of `counts` [G] rows (a device tensor
    summing to M) -> (rows [2M, K] bf16: each group's hi rows, then its lo rows; hi_pos [M] and
    lo_pos [M]: where row i's two parts went). No host read."""
    m = a.shape[0]
    group = torch.repeat_interleave(torch.arange(counts.shape[0], device=a.device), counts, output_size=m)   # [M]
    starts = counts.cumsum(0) - counts                                                    # [G] first row of each group
    hi_pos = torch.arange(m, device=a.device) + starts[group]                             # r + start
    lo_pos = hi_pos + counts[group]                                                       # r + start + count
    hi, lo = split_bf16(a)
    rows = a.new_empty(2 * m, a.shape[1], dtype=torch.bfloat16)
    rows.index_copy_(0, hi_pos, hi).index_copy_(0, lo_pos, lo)
    return rows, hi_pos, lo_pos


def merge_rows(products: torch.Tensor, hi_pos: torch.Tensor, lo_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The two parts' products [2M, N] summed back per row in `dtype` -> [M, N]."""
    return products.index_select(0, hi_pos).to(dtype) + products.index_select(0, lo_pos).to(dtype)


def batched_split_product(a: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """a [g, T, K] fp32 times w_t [g, K, N] bf16 with a split (one batched product over [g, 2T, K])
    -> [g, T, N] in a's dtype."""
    t = a.shape[1]
    hi, lo = split_bf16(a)
    o = torch.matmul(torch.cat([hi, lo], dim=1), w_t)                                    # [g, 2T, N]
    return o[:, :t].to(a.dtype) + o[:, t:].to(a.dtype)
