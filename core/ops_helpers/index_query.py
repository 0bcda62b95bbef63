"""The query side of every DSA index score (`k3.plugin.kernels.indexer`)."""

from __future__ import annotations

import torch

from k3.dtypes import upcast
from k3.quant.fp8 import fp8_quantize


def index_query(q: torch.Tensor, head_weights: torch.Tensor, *, quantize_query: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The query side of every index score, in `dtype`: (q [.., Hi, D], w [.., Hi]). With
    quantize_query, q rounded to fp8 e4m3fn per (token, head) (scale amax / 448) and the scale
    folded into the head weight (DeepSeek-V3.2's `act_quant` + `fp8_index`); else both upcast."""
    w = upcast(head_weights, dtype)
    if not quantize_query:
        return upcast(q, dtype), w
    q8, q_scale = fp8_quantize(q, block_size=q.shape[-1], dtype=torch.float8_e4m3fn)   # scale [.., Hi, 1]
    return q8.to(dtype), w * q_scale[..., 0].to(dtype)
