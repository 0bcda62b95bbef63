"""CUDA-graph capture of decode steps for the nvidia platform (`k3_graph_runner`).

The engine (k3.engine.graphs.DecodeGraphs) hands over one step function per batch-size
bucket, largest first. Each is warmed up on a side stream (Triton compilation, cuBLAS
handles, the caching allocator's first blocks), then recorded into a torch.cuda.CUDAGraph.
All graphs share one memory pool: they never run at the same time, so the buffers of the
largest capture serve every smaller one.
"""

from __future__ import annotations

import torch

WARMUP_CALLS = 2


class CudaGraphCapturer:
    def __init__(self):
        self.pool = None
        self.pool_bytes = 0            # memory the captures reserved (warm-ups and the shared pool)
        self._reserved_before: int | None = None

    def capture(self, fn):
        """(replay, outputs) of one recorded call of fn (see the k3_graph_runner hookspec)."""
        if self._reserved_before is None:
            # torch.cuda.graph empties the allocator's cache on entry, so the baseline is taken
            # with the cache empty too (else freed cached blocks make the difference negative)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self._reserved_before = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        if self.pool is None:
            self.pool = graph.pool()
        # the capacity plan does not count this yet (BENCHMARKS.md): measured here to size it, with
        # the warm-ups' freed blocks returned first (what stays reserved: the graphs' private pool
        # and the workspaces their kernels created)
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - self._reserved_before
        return graph.replay, outputs
