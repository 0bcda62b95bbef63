"""Attention visibility and the masked softmax, as the reference and the torch kernels apply
them: causal by position within the sequence, optionally restricted to DSA's top-k selection."""

from __future__ import annotations

import torch


def allowed_mask(
    q_pos: torch.Tensor,
    kv_len: int | torch.Tensor,
    *,
    max_kv: int,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [T, max_kv]: position s is visible to a query at q_pos[t] (s <= q_pos, s < kv_len).

    q_pos: int [T]; kv_len: int or int [T]; topk_indices: int [T, k] or None. With indices, only
    selected positions stay visible; -1 and out-of-range entries select nothing.
    """
    s = torch.arange(max_kv, device=q_pos.device)
    kv_len = torch.as_tensor(kv_len, device=q_pos.device).reshape(-1, 1)
    ok = (s <= q_pos[:, None]) & (s < kv_len)  # [T, max_kv]
    if topk_indices is None:
        return ok
    idx = topk_indices.long()
    idx = torch.where((idx >= 0) & (idx < max_kv), idx, max_kv)  # invalid -> spill column
    sel = torch.zeros(idx.shape[0], max_kv + 1, dtype=torch.bool, device=q_pos.device)
    sel.scatter_(1, idx, True)
    return ok & sel[:, :max_kv]


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis of scores where allowed, zeros on rows with nothing allowed."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, 0.0))  # masked -> exp(-inf) = 0
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def check_topk_indices(topk_indices: torch.Tensor | None, T: int, op: str) -> None:
    """Raise the contract's error unless topk_indices is None or an integer tensor [T, k]."""
    if topk_indices is not None and (
        topk_indices.dim() != 2 or topk_indices.shape[0] != T or topk_indices.is_floating_point()
    ):
        raise ValueError(
            f"{op}: topk_indices must be an integer tensor [T={T}, k]; "
            f"got {topk_indices.dtype} {tuple(topk_indices.shape)}"
        )
