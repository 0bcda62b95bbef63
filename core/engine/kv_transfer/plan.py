"""The transfer plan of one request: which bytes each consumer TP rank reads from which producer
TP rank (docs/disaggregation.md, "Tensor and data parallelism").

Under tensor parallelism every rank holds the same row indices (its TP leader allocates them
for all) but not the same bytes: MLA latents and DSA index keys are replicated, KDA heads are
split. So with equal TP sizes consumer rank r reads every row from producer rank r, whole (one
read per row and rank). With different sizes the attention rows are still copied whole (from
producer rank r mod P: their regions do not depend on the TP size), and the KDA state row is
re-sharded by heads: consumer rank c holds heads [c H/C, (c + 1) H/C), and for each producer
rank p whose heads overlap them it reads, per KDA layer, the overlap of the recurrent state
(heads are its outer dimension: one range) and of the conv window (channels [3, heads, head
dim]: one range for each of q, k, v).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.cache.plan import Region, RowLayout


@dataclass(frozen=True)
class Segment:
    """Bytes [src_offset, + nbytes) of a producer rank's row into [dst_offset, ...) of ours."""

    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class Read:
    """One backend read: `nbytes` at `remote` of the producer at `peer` into our `local`."""

    peer: str
    remote: int
    local: int
    nbytes: int


def _attention_end(layout: RowLayout) -> int:
    return max((r.offset + r.nbytes for r in layout.attention_regions), default=0)


def attention_segments(src: RowLayout, dst: RowLayout, *, src_tp: int, dst_tp: int, dst_rank: int) -> list[Segment]:
    """An attention row's reads for consumer rank `dst_rank` (a whole row when the TP sizes match)."""
    if src_tp == dst_tp:
        return [Segment(dst_rank, 0, 0, dst.row_bytes)]
    if src.attention_regions != dst.attention_regions:
        raise ValueError("the producer's attention rows have another format")
    return [Segment(dst_rank % src_tp, 0, 0, _attention_end(dst))] if dst.attention_regions else []


def state_segments(src: RowLayout, dst: RowLayout, *, heads: int, src_tp: int, dst_tp: int,
                   dst_rank: int) -> list[Segment]:
    """The KDA state row's reads for consumer rank `dst_rank` of `dst_tp`, from producer ranks
    of `src_tp` (`heads`: the model's KDA heads, split over each side's ranks)."""
    if src_tp == dst_tp:
        return [Segment(dst_rank, 0, 0, dst.row_bytes)]
    if heads % src_tp or heads % dst_tp:
        raise ValueError(f"{heads} KDA heads do not split over {src_tp} and {dst_tp} ranks")
    src_regions = {r.name: r for r in src.state_regions}
    hs, hc = heads // src_tp, heads // dst_tp
    lo_c, hi_c = dst_rank * hc, (dst_rank + 1) * hc
    out = []
    for region in dst.state_regions:
        theirs = src_regions[region.name]
        parts = 3 if region.name.endswith(".conv") else 1          # conv channels: [q | k | v][heads][head dim]
        per_head = _per_head(region, hc * parts, theirs, hs * parts)
        for p in range(lo_c // hs, -(-hi_c // hs)):
            lo, hi = max(lo_c, p * hs), min(hi_c, (p + 1) * hs)
            for part in range(parts):
                out.append(Segment(p, theirs.offset + (part * hs + lo - p * hs) * per_head,
                                   region.offset + (part * hc + lo - lo_c) * per_head, (hi - lo) * per_head))
    return out


def _per_head(mine: Region, my_units: int, theirs: Region, their_units: int) -> int:
    """Bytes of one head (of one of q, k, v for the conv window) in both regions."""
    if mine.nbytes % my_units or theirs.nbytes % their_units or mine.nbytes // my_units != theirs.nbytes // their_units:
        raise ValueError(f"KDA region {mine.name} does not split by heads the same way on both sides")
    return mine.nbytes // my_units


def rank_reads(handle, src: RowLayout, dst: RowLayout, *, heads: int, dst_tp: int, dst_rank: int, dst_base: int,
               pairs: list[tuple[int, int]]) -> list[Read]:
    """Consumer rank `dst_rank`'s reads (its cache registered at `dst_base`) of the request
    `handle` names: `pairs` (producer row, our row), the last one the KDA state row."""
    src_tp = handle.tp_size
    attention = attention_segments(src, dst, src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank)
    state = state_segments(src, dst, heads=heads, src_tp=src_tp, dst_tp=dst_tp, dst_rank=dst_rank)
    reads = []
    for j, (remote_row, local_row) in enumerate(pairs):
        for seg in (state if j == len(pairs) - 1 else attention):
            peer, base = handle.rank(seg.src_rank)
            reads.append(Read(peer, base + remote_row * handle.row_bytes + seg.src_offset,
                              dst_base + local_row * dst.row_bytes + seg.dst_offset, seg.nbytes))
    return reads


__all__ = ["Read", "Segment", "attention_segments", "rank_reads", "state_segments"]
