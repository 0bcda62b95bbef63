"""Expert-parallel dispatch and combine for the routed experts (`ParallelContext.ep`).

Each (token, top-k slot) row of the latent goes to the EP rank that owns its expert (experts
in contiguous blocks of E / ep_size), the owner runs its local experts through the platform's
`moe.experts` entry, the results come back by the reverse all-to-all and are summed per token
with the routing weights (in the compute dtype; each row arrives in the activation dtype, so
bf16 rounds once more than without EP). Rows are sorted by global expert id before sending, so
a rank's rows arrive grouped by source rank, then by local expert: the per-(peer, local
expert) counts, exchanged first, are all a receiver needs to know which expert each row is for.

Two variants (`ExpertParallel.dispatch`):
- "all_to_all": the counts are read on the host to size the payload all-to-all exactly (one
  synchronisation per MoE layer).
- "all_to_all_static": no host synchronisation (decode, graph capture): every peer's block is
  `capacity` tokens x top_k rows, the padding rows are zero, and the receiver runs its local
  experts masked (`dense_dispatch`) with routing weight 0 on the padding. The capacity must
  bound every rank's tokens and be the same on every rank.

With zero local tokens (T = 0) both variants still take part in every collective, which is what
`K3ForCausalLM.idle_forward` relies on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .parallel import ExpertParallel, check_dispatch

# run(x [N, L], ids int64 [N, 1] global, weights [N, 1], dense_dispatch) -> [N, L]
RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def peer_rows(ep: ExpertParallel, dispatch: str | None, capacity: int | None, tokens: int, *, top_k: int,
              tp_size: int) -> int | None:
    """Rows per peer block of the static dispatch for one MoE call of `tokens` tokens (before
    the TP slice), or None for the host-synchronised "all_to_all". dispatch / capacity: the
    step's overrides of `ep.dispatch` / `ep.capacity` (None: the record's)."""
    dispatch = dispatch or ep.dispatch
    capacity = ep.capacity if capacity is None else capacity
    check_dispatch(dispatch, capacity)
    if dispatch == "all_to_all":
        return None
    if capacity is None:
        raise ValueError("expert-parallel dispatch 'all_to_all_static' needs a capacity (the most tokens any "
                         "rank passes to one MoE call, the same on every rank): ParallelContext.from_groups("
                         "capacity=...) or the forward's ep_capacity")
    if tokens > capacity:
        raise ValueError(f"{tokens} tokens in one MoE call exceed the expert-parallel capacity of {capacity} tokens")
    per_rank = -(-capacity // tp_size) if ep.split_tokens_over_tp else capacity
    return per_rank * top_k


def tp_slice(tokens: int, rank: int, size: int) -> tuple[int, int, int]:
    """(lo, hi, c): TP rank `rank` of `size` dispatches tokens [lo, hi) of a step's replicated
    tokens, in slices of c = ceil(tokens / size) (the last ones short or empty)."""
    c = -(-tokens // size)
    return min(tokens, rank * c), min(tokens, (rank + 1) * c), c


def dispatch_combine(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, ep: ExpertParallel,
                     num_experts: int, run: RunExperts, capacity_rows: int | None = None) -> torch.Tensor:
    """u[t] = sum_i weights[t, i] * E_{ids[t, i]}(z[t]) over the whole EP group.

    z [T, L] this rank's latent rows; ids int [T, k] global expert ids; weights [T, k] routing
    weights (compute dtype). capacity_rows: rows per peer block of the static variant (must be
    >= T * k on every rank; None selects the host-synchronised variant). Returns [T, L] z.dtype.
    """
    t, k = ids.shape
    el = num_experts // ep.size
    start = ep.rank * el
    flat = ids.reshape(-1).long()                                          # [T k]
    order = torch.argsort(flat, stable=True)                               # by expert, so by owner
    rows = z[order // k]                                                   # [T k, L] sorted
    # rows per expert; scatter_add, not bincount (which reads the max on the host on CUDA)
    counts = torch.zeros(num_experts, dtype=torch.long, device=z.device).scatter_add_(0, flat, torch.ones_like(flat))
    recv_counts = ep.all_to_all_single(counts).view(ep.size, el)           # [src, local expert]
    per_dest = counts.view(ep.size, el).sum(1)                             # [ep] rows to each peer
    if capacity_rows is None:
        back = _exact(rows, per_dest, recv_counts, ep, start, run)
    else:
        back = _static(rows, flat[order] // el, per_dest, recv_counts, ep, start, run, capacity_rows)
    out = torch.empty_like(back)
    out[order] = back                                                      # [T k, L] in (token, slot) order
    cd = torch.promote_types(z.dtype, weights.dtype)
    return (out.view(t, k, z.shape[1]).to(cd) * weights.to(cd).unsqueeze(-1)).sum(1).to(z.dtype)


def _exact(rows, per_dest, recv_counts, ep, start, run):
    """Payload sized by the counts read on the host (one synchronisation)."""
    el = recv_counts.shape[1]
    send_splits, recv_splits = torch.stack([per_dest, recv_counts.sum(1)]).tolist()
    x = ep.all_to_all_single(rows, recv_splits, send_splits)               # [N, L] grouped (src, expert)
    n = x.shape[0]
    local = torch.arange(el, device=x.device).repeat(ep.size)              # [src el]
    ids = (start + torch.repeat_interleave(local, recv_counts.reshape(-1), output_size=n)).unsqueeze(1)  # [N, 1]
    y = run(x, ids, x.new_ones(n, 1, dtype=torch.promote_types(x.dtype, torch.float32)), False)   # [N, L]
    return ep.all_to_all_single(y, send_splits, recv_splits)              # [T k, L] sorted


def _static(rows, dest, per_dest, recv_counts, ep, start, run, cap):
    """Payload in equal blocks of `cap` rows per peer; no host synchronisation."""
    el = recv_counts.shape[1]
    n, device = rows.shape[0], rows.device
    if n > cap:
        raise ValueError(f"expert-parallel static dispatch: {n} rows exceed the per-peer capacity of {cap} rows")
    offset = torch.cumsum(per_dest, 0) - per_dest                          # [ep] first sorted row per peer
    slot = dest * cap + torch.arange(n, device=device) - offset[dest]      # [T k] row's place in the payload
    send = rows.new_zeros(ep.size * cap, rows.shape[1])
    send[slot] = rows
    x = ep.all_to_all_single(send)                                         # [ep cap, L] blocks by source
    ends = torch.cumsum(recv_counts, 1)                                    # [src, el]
    pos = torch.arange(cap, device=device).expand(ep.size, cap).contiguous()
    local = torch.searchsorted(ends, pos, right=True)                      # [src, cap]; el: padding
    valid = (local < el).reshape(-1, 1)                                    # [ep cap, 1]
    ids = start + local.clamp(max=el - 1).reshape(-1, 1)                   # [ep cap, 1] always a local expert
    y = run(x, ids, valid.to(torch.promote_types(x.dtype, torch.float32)), True)   # padding weighs 0
    return ep.all_to_all_single(y)[slot]                                   # [T k, L] sorted
