"""Decode-step graphs for the ppu platform (`k3_graph_runner`): torch.compile's reduce-overhead
recipe with the graph recorded here, so the hook's contract (fixed output tensors, one replay
per bucket) holds exactly.

On a CUDA-compatible device each bucket's step is compiled with `torch.compile` where the device
supports it (Triton present: the H200 stand-in; a PPU has none and records its eager step),
warmed up on a side stream (compilation, library handles, the allocator's first blocks), then
recorded into a torch.cuda.CUDAGraph; every graph shares one memory pool. The CPU has no graphs:
the hook answers None there and every step runs eagerly.
"""

from __future__ import annotations

import torch

from k3.platforms.torch_kernels.device_support import compile_supported

WARMUP_CALLS = 3              # the first compiles; the next ones settle automatic dynamic shapes


class CompiledGraphCapturer:
    """`capture(fn) -> (replay, outputs)` (see the k3_graph_runner hookspec)."""

    def __init__(self, device: str):
        self.compile = compile_supported(device)
        self.pool = None

    def capture(self, fn):
        step = torch.compile(fn) if self.compile else fn
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, outputs
