"""The exact distributed top-k of decode context parallelism (DCP) for the DSA indexer.

Each of W ranks holds the index scores of its own tokens: token t lives on rank t % W at local
slot t // W (token-interleaved storage). The result is what one rank holding every score would
select with `k3.reference.indexer_topk`: the `topk` largest finite scores per row in the exact
order (score descending, ties to the lower global index), -1 padded when a row has fewer.

Protocol, per row (all rows of a call together, every step a fixed-shape all-gather):
1. Candidates. Each rank sorts its finite scores in the exact order (a stable descending sort of
   its local slots is the exact order: local slot order is global index order) and sends its
   best c = min(topk, ceil(1.5 * topk / W)) (score, global index) pairs, padded with (-inf, -1).
2. Cut-off. Every rank merges the W * c candidates it received into their top-k in the exact
   order; the k-th of them is the row's cut-off (none when fewer than topk candidates are finite).
   Every rank computes it from the same gathered bytes, so all agree without another message.
3. Resend. (Only when c < topk, i.e. W > 1.) A rank whose c-th sent candidate is finite and at or above the cut-off (or every
   finite one, when there is no cut-off) may hold more of the true top-k than it sent: it sends
   its full local top-`topk` for that row in a second all-gather ([M, topk] per rank, M the most
   rows any rank resends; skipped when no rank resends anything, which every rank knows).
4. Merge. The pool of each row is the round-1 candidates of the ranks that did not resend and
   the round-2 lists of those that did; its top-k in the exact order is the result, identical on
   every rank.

Exactness. The exact order is a total order, so the global top-k restricted to one rank is a
prefix of that rank's local order, of length <= topk. A rank that did not resend has its c-th
candidate strictly below the round-1 cut-off; the round-1 cut-off is a real token's score, so it
is at or below the true k-th element and every token the rank did not send is below the true
top-k. A rank that resent sent a prefix of length topk, which covers its whole share. So the
pool holds every member of the true top-k, and its top-k is the true top-k, ties included.

Wire format ("packed as 32-bit words"): a candidate is its score followed by its global index as
int32 words: 2 words (8 bytes) for fp32 / bf16 / fp16 scores (the score widened to fp32,
lossless), 3 words (12 bytes) for fp64 scores. No rounding: two distinct scores never compare
equal on the wire, so the result is exact for every dtype, including ties. The one-word format
(a 16-bit score key with a 16-bit ordinal, plus an exact round for the candidates sharing the
k-th key) is `k3.model.dcp_topk_packed`, which the model runs; its helpers (`ordered_topk`,
`pack` for the exact round, `candidate_count`) live here.

All functions are pure; `distributed_topk` runs the protocol over an `all_gather` callable and
`simulate_distributed_topk` runs the same steps for W simulated ranks in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

OVERSAMPLE = 1.5
# all_gather(x) -> [W, *x.shape]: every rank's x stacked in rank order
StackGather = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DistributedTopK:
    """indices [T, topk] int64: global token indices in the exact order, -1 padded;
    resent_rows: (rank, row) pairs that took the resend path (0: one round sufficed);
    wire_bytes: bytes this rank contributed to the all-gathers."""

    indices: torch.Tensor
    resent_rows: int
    wire_bytes: int


def candidate_count(topk: int, world: int) -> int:
    """c = min(topk, ceil(1.5 * topk / W)): the candidates each rank sends per row in round 1."""
    if topk < 1 or world < 1:
        raise ValueError(f"distributed top-k needs topk >= 1 and world >= 1, got topk={topk}, world={world}")
    return min(topk, math.ceil(OVERSAMPLE * topk / world))


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(scores [..., n] float, global index [..., n] int) -> int32 words [..., n, w]: the score's
    fp32 (fp64 for fp64 scores) bits, then the index. Lossless."""
    wire = _wire_dtype(scores.dtype)
    words = scores.to(wire).contiguous().view(torch.int32)
    words = words.reshape(*scores.shape, wire.itemsize // 4)                  # [..., n, 1 or 2]
    return torch.cat([words, index.to(torch.int32)[..., None]], -1)


def unpack(words: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack` for scores that were of `dtype`: (scores [..., n] in the wire float
    dtype, global index [..., n] int64)."""
    wire = _wire_dtype(dtype)
    scores = words[..., :-1].contiguous().view(wire).squeeze(-1)
    return scores, words[..., -1].long()


def ordered_topk(scores: torch.Tensor, index: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k first of each row of (scores [T, M], index [T, M]) in the exact order (finite
    scores descending, equal scores by index ascending): ([T, k], [T, k]), padded (-inf, -1)."""
    clean = torch.where(torch.isfinite(scores), scores, float("-inf"))
    by_index = torch.argsort(torch.where(index < 0, torch.iinfo(torch.int64).max, index), dim=-1, stable=True)
    s, i = clean.gather(-1, by_index), index.gather(-1, by_index)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices      # ties keep index order
    s, i = s.gather(-1, order), i.gather(-1, order)
    if s.shape[-1] < k:
        pad = k - s.shape[-1]
        s = torch.cat([s, s.new_full((s.shape[0], pad), float("-inf"))], -1)
        i = torch.cat([i, i.new_full((i.shape[0], pad), -1)], -1)
    s, i = s[:, :k], i[:, :k]
    return s, torch.where(torch.isfinite(s), i, -1)


def local_ordered(local_scores: torch.Tensor, k: int, *, rank: int, world: int) -> torch.Tensor:
    """This rank's first k tokens per row in the exact order, packed: int32 [T, k, w].
    local_scores [T, L]: slot j is global token j * world + rank (-inf: not a candidate)."""
    t, length = local_scores.shape
    index = (torch.arange(length, device=local_scores.device) * world + rank).expand(t, length)
    s, i = ordered_topk(local_scores, index, k)
    return pack(s, i)


def resend_flags(gathered: torch.Tensor, *, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """bool [W, T]: rank w must resend row t. gathered: round-1 words [W, T, c, w]."""
    world, t, c, _ = gathered.shape
    if c >= topk:                                 # every rank sent its whole top-k already (W = 1)
        return torch.zeros(world, t, dtype=torch.bool, device=gathered.device)
    s, i = unpack(gathered, dtype)                                            # [W, T, c]
    merged_s, merged_i = ordered_topk(s.permute(1, 0, 2).reshape(t, world * c),
                                      i.permute(1, 0, 2).reshape(t, world * c), topk)
    cut_s, cut_i = merged_s[:, -1], merged_i[:, -1]                           # [T]: the k-th, or (-inf, -1)
    last_s, last_i = s[..., -1], i[..., -1]                                   # [W, T]: each rank's c-th
    full = torch.isfinite(cut_s)
    at_or_above = (last_s > cut_s) | ((last_s == cut_s) & (last_i <= cut_i))
    return torch.isfinite(last_s) & (~full | at_or_above)


def resend_payload(local_scores: torch.Tensor, rows: torch.Tensor, most: int, *, topk: int, rank: int,
                   world: int) -> torch.Tensor:
    """Round 2 of this rank: its full local top-`topk` of the rows it resends (bool [T]), in row
    order, padded to `most` rows: int32 [most, topk, w]."""
    mine = local_ordered(local_scores[rows], topk, rank=rank, world=world)    # [n, topk, w]
    pad = pack(local_scores.new_full((most - mine.shape[0], topk), float("-inf")),
               torch.full((most - mine.shape[0], topk), -1, dtype=torch.long, device=local_scores.device))
    return torch.cat([mine, pad])


def merge(first: torch.Tensor, flags: torch.Tensor, second: torch.Tensor | None, *, topk: int,
          dtype: torch.dtype) -> torch.Tensor:
    """The global top-k [T, topk] int64 from round 1's words [W, T, c, w], the resend flags
    [W, T] and round 2's words [W, M, topk, w] (None when no rank resent)."""
    world, t, c, w = first.shape
    s, i = unpack(first, dtype)                                               # [W, T, c]
    pad = topk - c
    s = torch.cat([s, s.new_full((world, t, pad), float("-inf"))], -1)        # [W, T, topk]
    i = torch.cat([i, i.new_full((world, t, pad), -1)], -1)
    if second is not None:
        s2, i2 = unpack(second, dtype)                                        # [W, M, topk]
        for rank in range(world):
            rows = flags[rank].nonzero().squeeze(-1)
            s[rank, rows], i[rank, rows] = s2[rank, : rows.numel()], i2[rank, : rows.numel()]
    return ordered_topk(s.permute(1, 0, 2).reshape(t, world * topk), i.permute(1, 0, 2).reshape(t, world * topk),
                        topk)[1]


def distributed_topk(local_scores: torch.Tensor, *, topk: int, rank: int, world: int,
                     all_gather: StackGather) -> DistributedTopK:
    """The exact global top-k of the rows whose scores are spread over the ranks (module
    docstring). local_scores [T, L_r]: this rank's tokens, slot j = global token j * world +
    rank, -inf where no candidate (masked, padding); L_r may differ between ranks, T may not.
    Every rank of the group must call it with the same T, topk and world. Returns the same
    indices on every rank."""
    c = candidate_count(topk, world)
    mine = local_ordered(local_scores, c, rank=rank, world=world)             # [T, c, w]
    first = all_gather(mine)                                                  # [W, T, c, w]
    flags = resend_flags(first, topk=topk, dtype=local_scores.dtype)          # [W, T]
    counts = flags.sum(-1)
    most = int(counts.max())                                                  # host read (same on all ranks)
    wire = mine.numel() * 4
    second = None
    if most:
        payload = resend_payload(local_scores, flags[rank], most, topk=topk, rank=rank, world=world)
        second = all_gather(payload)                                          # [W, M, topk, w]
        wire += payload.numel() * 4
    return DistributedTopK(merge(first, flags, second, topk=topk, dtype=local_scores.dtype), int(counts.sum()), wire)


def interleave(scores: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Rank r's local scores [T, ceil((L - r) / W)] of full scores [T, L]: tokens r, r + W, ..."""
    return [scores[:, r::world] for r in range(world)]


def simulate_distributed_topk(scores: torch.Tensor, *, topk: int, world: int) -> DistributedTopK:
    """`distributed_topk` for `world` simulated ranks in one process over full scores [T, L]
    (the same steps; ragged local lengths as the interleave gives them). Returns rank 0's
    result after checking every simulated rank's equals it."""
    locals_ = interleave(scores, world)
    c = candidate_count(topk, world)
    first = torch.stack([local_ordered(x, c, rank=r, world=world) for r, x in enumerate(locals_)])
    flags = resend_flags(first, topk=topk, dtype=scores.dtype)
    most = int(flags.sum(-1).max())
    second = None
    if most:
        second = torch.stack([resend_payload(x, flags[r], most, topk=topk, rank=r, world=world)
                              for r, x in enumerate(locals_)])
    out = merge(first, flags, second, topk=topk, dtype=scores.dtype)
    wire = first[0].numel() * 4 + (0 if second is None else second[0].numel() * 4)
    return DistributedTopK(out, int(flags.sum()), wire)


def stack_gather(all_gather_dim0: Callable[[torch.Tensor, int], torch.Tensor]) -> StackGather:
    """A StackGather over a concatenating all_gather(x, dim) (`Collectives.all_gather`)."""
    return lambda x: all_gather_dim0(x.unsqueeze(0), 0)


__all__ = ("DistributedTopK", "candidate_count", "distributed_topk", "interleave", "merge",
                          "ordered_topk", "pack", "resend_flags", "resend_payload", "simulate_distributed_topk",
                          "stack_gather", "unpack")
