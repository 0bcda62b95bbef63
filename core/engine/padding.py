"""Static-shape padding of a step (a platform's `k3_shape_buckets`, e.g. XLA).

A compiling backend builds one program per tensor shape; the engine pads each step's host
metadata to the platform's buckets before the upload, so every step of a bucket has the same
shapes. With N sequences and T packed tokens, a step becomes B = batch bucket sequences and
T_b = token bucket tokens (a step of one-token decodes pads to B tokens: decode is bucketed by
its batch alone, so it stays a decode step and replays its decode graph):

- padding sequences are appended after the real ones: all but the last bring one token, the
  last the rest of T_b - T; they are fresh (context 0, so their KDA state starts from zero and
  no cached state is read), every token is written into the scratch row (slot
  scratch * block + position % block) and their block tables and state index name the scratch
  row only, so no request's row is read or written by them;
- every block table is widened to the longest sequence's width (`max_pages`; a real row repeats
  its last page, whose positions past the sequence are masked);
- the logits rows are padded to the batch bucket with the last padding token, and the runner
  samples at the bucket, dropping the padded samples.

Speculative verification steps are not padded (their per-draft shapes are the proposer's).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.plugin.types import ShapeBuckets


@dataclass
class HostStep:
    """A step's metadata as host lists, in `build_metadata`'s order (what padding extends)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    lens: list[int]
    context: list[int]
    table: list[list[int]]
    state_rows: list[int]
    logits_at: list[int]
    decodes: list[bool]
    seq_slots: list[int]
    ckpt_pos: list[list[int]]
    ckpt_rows: list[list[int]]


@dataclass(frozen=True)
class StepPadding:
    """Pads steps to `buckets`. scratch_row: a cache row no request owns (the planner's
    graph scratch row); max_pages: the block-table width of every padded step."""

    buckets: ShapeBuckets
    scratch_row: int
    block_size: int
    max_pages: int

    def shape(self, num_seqs: int, num_tokens: int, all_decodes: bool) -> tuple[int, int]:
        """(B, T_b) of a step of num_seqs sequences and num_tokens tokens: T_b - T padding tokens
        over B - N padding sequences, each with at least one token."""
        b = self.buckets.batch_for(num_seqs)
        if all_decodes:
            return b, num_tokens + (b - num_seqs)
        t = self.buckets.tokens_for(num_tokens + (b - num_seqs))
        if t > num_tokens and b == num_seqs:     # padding tokens need a padding sequence to carry them
            b = self.buckets.batch_for(num_seqs + 1)
            t = self.buckets.tokens_for(num_tokens + (b - num_seqs))
        return b, t

    def pad(self, h: HostStep) -> None:
        """Extend `h` in place to its bucket shape."""
        n, t = len(h.lens), len(h.ids)
        all_decodes = all(h.decodes) and all(q == 1 for q in h.lens)
        b, tb = self.shape(n, t, all_decodes)
        extra = b - n
        pad_lens = [1] * (extra - 1) + [tb - t - (extra - 1)] if extra else []
        scratch, block = self.scratch_row, self.block_size
        width = max([self.max_pages] + [len(row) for row in h.table])
        h.table[:] = [row + [row[-1]] * (width - len(row)) for row in h.table]
        ckpt_width = len(h.ckpt_pos[0]) if h.ckpt_pos else 0
        for q in pad_lens:
            h.ids += [0] * q
            h.positions += range(q)
            h.slots += [scratch * block + p % block for p in range(q)]
            h.lens.append(q)
            h.context.append(0)
            h.table.append([scratch] * width)
            h.state_rows.append(scratch)
            h.decodes.append(all_decodes)
            h.seq_slots.append(-1)
            if ckpt_width:
                h.ckpt_pos.append([-1] * ckpt_width)
                h.ckpt_rows.append([scratch] * ckpt_width)
        rows = b if len(h.logits_at) <= b else self.buckets.tokens_for(len(h.logits_at))
        h.logits_at += [tb - 1] * (rows - len(h.logits_at))
