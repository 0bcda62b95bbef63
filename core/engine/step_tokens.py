"""Tokens per engine step, as a cumulative histogram (vLLM's `iteration_tokens_total`).

The scheduler observes every committed step: the tokens it put in the cache (prefill chunks,
decodes, the kept tokens of a verify step). `to_dict` is what the engine's snapshot carries and
the server's /metrics renders; over DP ranks it is rank 0's (it is not an integer counter).
"""

from __future__ import annotations

import bisect

# vLLM's buckets of vllm:iteration_tokens_total
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenHistogram:
    """Counts of steps by tokens computed, in STEP_TOKEN_BUCKETS (upper bounds, inclusive)."""

    def __init__(self):
        self.counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)    # the last: above the largest bound
        self.sum = 0
        self.count = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens
        self.count += 1

    def to_dict(self) -> dict:
        """{"buckets": upper bounds, "counts": steps per bucket (not cumulative; one more entry,
        for +Inf), "sum": tokens, "count": steps}."""
        return {"buckets": list(STEP_TOKEN_BUCKETS), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}
