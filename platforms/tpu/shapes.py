"""Static-shape buckets of the tpu platform (`k3_shape_buckets`).

XLA compiles one program per set of tensor shapes, so the engine pads every step to a bucket
(`k3.engine.padding`) and a bucket compiles once. Batch buckets are powers of two up to
max_num_seqs (then max_num_seqs itself): a decode step of N sequences replays the graph of the
smallest bucket >= N. Token buckets (the packed tokens of a prefill or mixed step, so the
prefill-chunk length) are powers of two from 16 up to max_num_batched_tokens (then it): few
programs, at most 2x padding.
"""

from __future__ import annotations

from k3.plugin.types import ShapeBuckets

MIN_TOKENS = 16


def powers_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... below limit, then limit."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def buckets(max_num_seqs: int, max_num_batched_tokens: int) -> ShapeBuckets:
    return ShapeBuckets(batch=tuple(powers_to(max(1, max_num_seqs))),
                        tokens=tuple(powers_to(max(MIN_TOKENS, max_num_batched_tokens), MIN_TOKENS)))
