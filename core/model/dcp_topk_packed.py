"""The DCP top-k's one-word wire format: each candidate is one 32-bit word (16-bit score key,
16-bit ordinal), with an exact round for the candidates that share the k-th key.

`k3.model.dcp_topk` sends every candidate losslessly (2 int32 words for fp32 scores). This
module halves round 1 (and the resend): a candidate travels as

    word = key << 16 | ordinal        (one int32)

- key (16 bits): an order-preserving code of the score rounded to bf16 (`score_key`): for two
  finite scores, a <= b implies key(a) <= key(b) (rounding to nearest is monotone; -0 is folded
  onto +0), so the keys of a rank's list in the exact order never increase. Key 0 means "no
  candidate" (masked, padding); every finite score has a key >= 1. Distinct scores may share a
  key (it is lossy).
- ordinal (16 bits): the candidate's position in its sender's exact order (0 .. topk - 1; topk
  must be at most 65536). The owner maps it back to its token; no other rank needs the token.

Protocol, per row (all rows of a call together, every step a fixed-shape all-gather; c =
`candidate_count(topk, W)`):
1. Candidates. Each rank sends the words of its best c tokens in the exact order (as
   `k3.model.dcp_topk`).
2. Cut-off. K1 = the k-th largest key among the W * c gathered (0 when fewer than topk are
   candidates).
3. Resend (only when c < topk). A rank whose c-th word is a candidate with key >= K1 (any key,
   when K1 = 0) sends the words of its local top-`topk` for that row.
4. Key cut. The pool is the round-1 words of the ranks that did not resend and the round-2
   words of those that did. K = the k-th largest key of the pool; keys > K are selected, keys <
   K are not. n_eq pool words have key K and `need` = topk - #(key > K) of them are selected.
5. Exact round, only for rows with n_eq > need (the lossy key hides the order at the cut):
   each rank sends its first min(need, its n_eq) key-K tokens losslessly (`dcp_topk.pack`:
   score and global index); everyone takes their top-`need` in the exact order. Skipped when no
   row needs it, which every rank knows from the gathered keys.

Exactness. Write s_k for the true k-th score and K* = key(s_k). A key > K* means a score > s_k
(in the top-k), a key < K* a score < s_k (out). K1 <= K* (the k-th of a subset). A rank that
did not resend has its c-th key < K1 <= K*, so everything it did not send is out and every
key-K* token it holds is in the pool; a rank that resent sent its local top-`topk`, which holds
its share of the true top-k. So the pool holds the whole true top-k, hence K = K*. Among the
key-K tokens the true winners on one rank are a prefix of its key-K tokens in its exact order,
at most `need` long and inside the pool: step 5 receives all of them, and their top-`need` in
the exact order (score, then lower global index) is the true choice, ties included.

Result. Every rank learns the exact selection of its own tokens (a mask over its local
positions is all the DCP attention needs); the order of the whole top-k across ranks is not
sent (it would need every selected score losslessly). Bytes: 4 per candidate in rounds 1 and 2
(8 and 12 for fp32 and fp64 scores in `k3.model.dcp_topk`), plus the exact round's lossless
words for the tied rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dcp_topk import StackGather, candidate_count, ordered_topk, pack, unpack

KEY_BITS = 16
NO_CANDIDATE = 0


@dataclass(frozen=True)
class PackedTopK:
    """mine [T, topk] int64: this rank's tokens (global indices) of the exact global top-k, in
    the exact order, -1 padded; resent_rows: (rank, row) pairs that took the resend path;
    tie_rows: rows that took the exact round; wire_bytes: bytes this rank contributed to the
    all-gathers (round 1, resend, exact round); round1_bytes: those of round 1 alone."""

    mine: torch.Tensor
    resent_rows: int
    tie_rows: int
    wire_bytes: int
    round1_bytes: int


def score_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys in [1, 65535] of finite scores (0 where not finite), order-preserving: the score
    rounded to bf16, its sign-magnitude bits mapped to an unsigned order, -0 folded onto +0."""
    bits = scores.to(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    bits = torch.where(bits == 0x8000, 0, bits)                              # -0 -> +0
    key = torch.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)        # -inf -> 0x7F, +inf -> 0xFF80
    return torch.where(torch.isfinite(scores), key, NO_CANDIDATE)


def pack_words(keys: torch.Tensor) -> torch.Tensor:
    """keys [..., n] (int64, 0 .. 65535) of a list in its sender's exact order -> int32 words
    [..., n]: key << 16 | ordinal (the position in the list)."""
    n = keys.shape[-1]
    if n > 1 << KEY_BITS:
        raise ValueError(f"the one-word DCP top-k format holds ordinals below {1 << KEY_BITS}; got a list of {n}")
    ordinal = torch.arange(n, device=keys.device).expand_as(keys)
    word = keys * (1 << KEY_BITS) + ordinal
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_words`: (keys, ordinals), int64, words' shape."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return w >> KEY_BITS, w & ((1 << KEY_BITS) - 1)


def _kth_key(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """[T]: the topk-th largest of keys [T, n] (NO_CANDIDATE when fewer than topk candidates)."""
    if keys.shape[-1] < topk:
        return keys.new_full(keys.shape[:1], NO_CANDIDATE)
    return torch.topk(keys, topk, dim=-1).values[:, -1]


def resend_flags(first_keys: torch.Tensor, *, topk: int) -> torch.Tensor:
    """bool [W, T]: rank w resends row t. first_keys: round 1's keys [W, T, c]."""
    world, t, c = first_keys.shape
    if c >= topk:
        return torch.zeros(world, t, dtype=torch.bool, device=first_keys.device)
    cut = _kth_key(first_keys.permute(1, 0, 2).reshape(t, world * c), topk)   # [T]
    last = first_keys[..., -1]                                                # [W, T]
    return (last != NO_CANDIDATE) & ((cut == NO_CANDIDATE) | (last >= cut))


def pool_keys(first_keys: torch.Tensor, flags: torch.Tensor, second_keys: torch.Tensor | None, topk: int
              ) -> torch.Tensor:
    """[W, T, topk]: each rank's pool keys of each row (round 1's, or round 2's where it resent)."""
    world, t, c = first_keys.shape
    pool = torch.cat([first_keys, first_keys.new_zeros(world, t, topk - c)], -1)
    if second_keys is not None:
        for rank in range(world):
            rows = flags[rank].nonzero().squeeze(-1)
            pool[rank, rows] = second_keys[rank, : rows.numel()]
    return pool


@dataclass(frozen=True)
class KeyCut:
    """The key cut of every row from the pool: cut [T] (K, NO_CANDIDATE: take every candidate),
    need [T] (the key-K tokens to select), eq [W, T] (key-K pool words per rank), ties [T] bool
    (rows that need the exact round) and take [W, T] (words each rank sends in it)."""

    cut: torch.Tensor
    need: torch.Tensor
    eq: torch.Tensor
    ties: torch.Tensor
    take: torch.Tensor


def key_cut(pool: torch.Tensor, topk: int) -> KeyCut:
    """The `KeyCut` of pool keys [W, T, topk] (the same on every rank)."""
    world, t, _ = pool.shape
    flat = pool.permute(1, 0, 2).reshape(t, world * topk)
    cut = _kth_key(flat, topk)
    real = cut != NO_CANDIDATE
    above = ((flat > cut[:, None]) & real[:, None]).sum(-1)
    need = torch.where(real, topk - above, 0)
    eq = ((pool == cut[None, :, None]) & real[None, :, None]).sum(-1)        # [W, T]
    ties = eq.sum(0) > need
    take = torch.where(ties[None], torch.minimum(eq, need[None]), 0)
    return KeyCut(cut, need, eq, ties, take)


def _own_selection(keys: torch.Tensor, cut: KeyCut) -> torch.Tensor:
    """bool [T, topk] over this rank's local list (keys [T, topk], exact order) before the exact
    round: keys above the cut, keys at it in rows without ties, every candidate without a cut."""
    real = (keys != NO_CANDIDATE)
    c = cut.cut[:, None]
    no_cut = (cut.cut == NO_CANDIDATE)[:, None]
    return real & (no_cut | (keys > c) | ((keys == c) & ~cut.ties[:, None]))


def exact_payload(scores: torch.Tensor, index: torch.Tensor, keys: torch.Tensor, cut: KeyCut, rank: int,
                  width: int) -> torch.Tensor:
    """This rank's exact-round words [R, width, w] (R tie rows, in row order): its first
    take[rank] key-K tokens of each, losslessly packed, padded (-inf, -1)."""
    rows = cut.ties.nonzero().squeeze(-1)
    k, s, i = keys[rows], scores[rows], index[rows]
    start = (k > cut.cut[rows, None]).sum(-1)                                 # [R]: key-K group's first position
    pos = (start[:, None] + torch.arange(width, device=keys.device)).clamp(max=keys.shape[-1] - 1)
    keep = torch.arange(width, device=keys.device)[None] < cut.take[rank, rows][:, None]
    s = torch.where(keep, s.gather(-1, pos), float("-inf"))
    i = torch.where(keep, i.gather(-1, pos), -1)
    return pack(s, i)


def tie_winners(third: torch.Tensor, cut: KeyCut, dtype: torch.dtype) -> torch.Tensor:
    """[R, max need] global indices (-1 padded) selected among the key-K tokens of the tie rows,
    from the gathered exact-round words [W, R, width, w]."""
    world, r, width, _ = third.shape
    s, i = unpack(third, dtype)
    need = cut.need[cut.ties]                                                 # [R]
    s, i = ordered_topk(s.permute(1, 0, 2).reshape(r, world * width), i.permute(1, 0, 2).reshape(r, world * width),
                        int(need.max()))
    return torch.where(torch.arange(i.shape[-1], device=i.device)[None] < need[:, None], i, -1)


def _finish(s: torch.Tensor, i: torch.Tensor, keys: torch.Tensor, cut: KeyCut, winners: torch.Tensor | None
            ) -> torch.Tensor:
    """This rank's selection [T, topk] (global indices, exact order, -1 padded)."""
    sel = _own_selection(keys, cut)
    if winners is not None:               # membership per row: (row, index) as one int64 key, one sorted search
        rows = cut.ties.nonzero().squeeze(-1)
        span = int(max(i.max(), winners.max())) + 2
        at = torch.arange(rows.numel(), device=i.device)[:, None] * span
        won = torch.isin(i[rows] + 1 + at, (winners + 1 + at)[winners >= 0]) & (i[rows] >= 0)
        sel[rows] |= won
    order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)       # selected first, exact order kept
    return torch.where(sel, i, -1).gather(-1, order)


def _local_list(local_scores: torch.Tensor, topk: int, rank: int, world: int):
    t, length = local_scores.shape
    index = (torch.arange(length, device=local_scores.device) * world + rank).expand(t, length)
    s, i = ordered_topk(local_scores, index, topk)                            # [T, topk], exact order
    return s, i, score_key(s)


def packed_topk(local_scores: torch.Tensor, *, topk: int, rank: int, world: int, all_gather: StackGather
                ) -> PackedTopK:
    """The exact global top-k over one-word candidates (module docstring). local_scores [T, L_r]:
    this rank's tokens, slot j = global token j * world + rank, -inf where no candidate. Every
    rank of the group calls it with the same T, topk and world; each gets its own share."""
    c = candidate_count(topk, world)
    s, i, keys = _local_list(local_scores, topk, rank, world)
    mine1 = pack_words(keys[:, :c])
    first, _ = unpack_words(all_gather(mine1))                                # [W, T, c]
    round1 = wire = mine1.numel() * 4
    flags = resend_flags(first, topk=topk)
    most = int(flags.sum(-1).max())                                           # host read (same on all ranks)
    second = None
    if most:
        payload = pack_words(keys[flags[rank]])
        payload = torch.cat([payload, payload.new_zeros(most - payload.shape[0], topk)])
        second, _ = unpack_words(all_gather(payload))                         # [W, M, topk]
        wire += payload.numel() * 4
    cut = key_cut(pool_keys(first, flags, second, topk), topk)
    winners = None
    if bool(cut.ties.any()):
        width = int(cut.take.max())
        payload3 = exact_payload(s, i, keys, cut, rank, width)
        winners = tie_winners(all_gather(payload3), cut, local_scores.dtype)
        wire += payload3.numel() * 4
    return PackedTopK(_finish(s, i, keys, cut, winners), int(flags.sum()), int(cut.ties.sum()), wire, round1)


def simulate_packed_topk(scores: torch.Tensor, *, topk: int, world: int) -> list[PackedTopK]:
    """`packed_topk` for `world` simulated ranks in one process over full scores [T, L]: every
    rank's result (the same steps and gathered tensors as over a process group)."""
    lists = [_local_list(x, topk, r, world) for r, x in enumerate(scores[:, r::world] for r in range(world))]
    c = candidate_count(topk, world)
    sent1 = [pack_words(k[:, :c]) for _, _, k in lists]
    first, _ = unpack_words(torch.stack(sent1))
    flags = resend_flags(first, topk=topk)
    most = int(flags.sum(-1).max())
    second, sent2 = None, 0
    if most:
        payloads = [pack_words(k[flags[r]]) for r, (_, _, k) in enumerate(lists)]
        payloads = [torch.cat([p, p.new_zeros(most - p.shape[0], topk)]) for p in payloads]
        second, _ = unpack_words(torch.stack(payloads))
        sent2 = payloads[0].numel() * 4
    cut = key_cut(pool_keys(first, flags, second, topk), topk)
    winners, sent3 = None, 0
    if bool(cut.ties.any()):
        width = int(cut.take.max())
        third = torch.stack([exact_payload(s, i, k, cut, r, width) for r, (s, i, k) in enumerate(lists)])
        winners, sent3 = tie_winners(third, cut, scores.dtype), third[0].numel() * 4
    round1 = sent1[0].numel() * 4
    return [PackedTopK(_finish(s, i, k, cut, winners), int(flags.sum()), int(cut.ties.sum()),
                       round1 + sent2 + sent3, round1) for s, i, k in lists]


def gathered_selection(results: list[PackedTopK], scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The whole top-k [T, topk] in the exact order from every rank's `mine` and the full scores
    [T, L] (tests, benchmarks: what one rank holding everything would list)."""
    idx = torch.cat([r.mine for r in results], -1)
    s = torch.where(idx >= 0, scores.gather(-1, idx.clamp_min(0)), float("-inf"))
    return ordered_topk(s, idx, topk)[1]


def tie_worst_case_scores(kind: str, rows: int, length: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """[rows, length] float64 scores whose top-`topk` cut-off falls inside one tied value, spread
    over every rank (tests, benchmarks: the exact round's worst case): "allequal" (every score
    1.0), or "halfequal" (half the tokens, at random positions, exactly 0.0; topk / 2 others
    above it, the rest below)."""
    if kind == "allequal":
        return torch.ones(rows, length, dtype=torch.float64)
    scores = torch.empty(rows, length, dtype=torch.float64)
    for r in range(rows):
        perm = torch.randperm(length, generator=g)
        tied, above, below = perm[: length // 2], perm[length // 2: length // 2 + topk // 2], perm[length // 2 + topk // 2:]
        scores[r, tied] = 0.0
        scores[r, above] = torch.rand(above.numel(), generator=g, dtype=torch.float64) + 1
        scores[r, below] = -torch.rand(below.numel(), generator=g, dtype=torch.float64) - 1
    return scores


__all__ = ("KeyCut", "PackedTopK", "gathered_selection", "key_cut", "pack_words", "packed_topk", "resend_flags",
           "score_key", "simulate_packed_topk", "tie_worst_case_scores", "unpack_words")
