"""Block Attention Residuals (AttnRes): the depth-wise softmax mix that replaces K3's residual.

Per token, the sources are the completed block vectors plus the running partial sum. Keys are
the RMS-normalised sources, values the raw sources, the logit weight is one folded vector
`u = res_norm.weight * res_proj.weight` per mix (no temperature, no 1/sqrt(d)). The block bank
lives only inside one forward pass; nothing persists across decode steps.
"""

from __future__ import annotations

import torch

from k3.plugin.kernels import AttnResOut

from ..dtypes import compute_dtype
from .norms import rms_norm


def fold_attn_res_query(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """u = norm.weight * proj.weight, the mix's logit weight. proj_weight: [1, D] or [D]. Returns [D]."""
    return norm_weight.reshape(-1) * proj_weight.reshape(-1)


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, *, eps: float) -> torch.Tensor:
    """Oracle of `AttnResMix`: RMS-normalised keys, logits against the query, softmax over the
    sources, weighted sum of the raw values, cast to the activation dtype."""
    if sources.dim() != 3 or query.shape != (sources.shape[-1],):
        raise ValueError(f"attn_res_mix: sources [S, T, D] and query [D] expected, got "
                         f"{tuple(sources.shape)} and {tuple(query.shape)}")
    cd = compute_dtype(sources)
    v = sources.to(cd)                                               # [S, T, D]
    inv_rms = torch.rsqrt(v.pow(2).mean(-1) + eps)                   # [S, T]
    logits = (v @ query.to(cd)) * inv_rms                            # [S, T]
    p = torch.softmax(logits, dim=0)
    return (p.unsqueeze(-1) * v).sum(0).to(sources.dtype)


def attn_res(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    *,
    query: torch.Tensor,
    num_visible_blocks: int,
    write_index: int | None,
    eps: float,
    out_norm_weight: torch.Tensor | None,
    out_eps: float,
) -> AttnResOut:
    """Oracle of `AttnResStep`: the protocol's four steps, in order (vLLM's `attn_res` contract)."""
    return attn_res_with(attn_res_mix, rms_norm, prefix, delta, blocks, query=query,
                         num_visible_blocks=num_visible_blocks, write_index=write_index, eps=eps,
                         out_norm_weight=out_norm_weight, out_eps=out_eps)


def attn_res_with(mix, norm, prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, *,
                  query: torch.Tensor, num_visible_blocks: int, write_index: int | None, eps: float,
                  out_norm_weight: torch.Tensor | None, out_eps: float) -> AttnResOut:
    """`attn_res`'s four steps with `mix` (as `attn_res_mix`) and `norm` (as `rms_norm`) given:
    the batch-invariant kernels run them with their own."""
    if delta is not None:
        prefix = (prefix + delta).to(prefix.dtype)
    if write_index is not None:
        blocks[:, write_index] = prefix
    if num_visible_blocks == 0:
        h = prefix
    else:
        sources = torch.cat([blocks[:, :num_visible_blocks].transpose(0, 1), prefix.unsqueeze(0)], dim=0)
        h = mix(sources, query, eps=eps)
    if out_norm_weight is not None:
        h = norm(h, out_norm_weight, out_eps)
    return AttnResOut(h, prefix)
