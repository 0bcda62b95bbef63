"""Decode-step graphs for the ppu platform (`k3_graph_runner`): torch.compile's reduce-overhead
recipe (compiled kernels replayed from CUDA graphs) with the graph recorded here, so the hook's
contract (fixed output tensors, one replay per bucket) holds exactly.

On a CUDA-compatible device each bucket's step is warmed up on a side stream (the compiled
entries of `native_tables` compile there, where the device supports `torch.compile`; library
handles; the allocator's first blocks), then recorded into a torch.cuda.CUDAGraph; every graph
shares one memory pool. The whole step is compiled as one function only with
K3_PPU_COMPILE_STEP=1 (and compile support): dynamo unrolls the MoE layers' group loops, so a
full-width model takes minutes per bucket to compile, which start-up should not pay by default.
The CPU has no graphs: the hook answers None there and every step runs eagerly.
"""

from __future__ import annotations

import os

import torch

from k3.platforms.torch_kernels.device_support import compile_supported

STEP_ENV = "K3_PPU_COMPILE_STEP"

WARMUP_CALLS = 3              # the first compiles; the next ones settle automatic dynamic shapes


class CompiledGraphCapturer:
    """`capture(fn) -> (replay, outputs)` (see the k3_graph_runner hookspec)."""

    # the torch MLA decode and indexer gather and mask every page of the block table, so a graph
    # at the model's full width costs max_model_len positions a sequence whatever its length:
    # `k3.engine.graphs.DecodeGraphs` also replays narrower context bounds
    table_width_buckets = True

    def __init__(self, device: str):
        self.compile = compile_supported(device) and os.environ.get(STEP_ENV) == "1"
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
        # the warm-up's blocks are cached on the side stream, where the graph's private pool cannot
        # reuse them: give them back first, so a capture needs one step's activations, not two
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, outputs
