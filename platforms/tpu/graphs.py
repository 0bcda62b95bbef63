"""XLA "capture" of decode steps for the tpu platform (`k3_graph_runner`).

torch-xla traces lazily: calling the step function records an XLA graph, and
`torch_xla.sync()` compiles it (once per graph shape; the compiled executable is cached by
the graph's hash) and runs it. Capturing a bucket therefore means running its step once and
syncing (the compilation), and replaying means re-tracing the same step on the same static
metadata tensors (same shapes, same graph hash: no compilation) and copying its results into
the captured outputs, so the caller reads them where the capture returned them.

`pads_on_host = True` asks `k3.engine.graphs.DecodeGraphs` to pad a step's metadata to the
bucket on the host before the upload: a device-side copy of N rows into a bucket of B would
put N into the graph and compile one graph per batch size instead of one per bucket.

`table_width_buckets = True`: the decode kernels served here gather and mask every position of
the block table (the torch MLA decode and paged index scores, as on ppu), so a graph at the
full width (max_model_len) reads max_model_len positions a sequence however short the batch's
contexts are. With it, `DecodeGraphs` also compiles each batch bucket at narrower context
bounds (`k3.engine.graphs.context_buckets`: 256 tokens, x4 each), each the first time a step
needs it, and a step replays the narrowest that holds its longest sequence: one program per
(batch bucket, bound) as vLLM's TPU runner compiles per padded block-table width.

`step_end` (`k3_step_end`) is the same cut for eager steps: the engine calls it after each
forward, so a prefill or mixed step is one graph too.
"""

from __future__ import annotations

import torch


def step_end() -> None:
    """`k3_step_end`: cut the lazy trace after a forward, so each engine step is one graph
    (compiled once per step shape) and launched now, without waiting for it. Without it the
    cache tensors keep every earlier step's pending trace: measured on k3-tiny's chunked
    prefill on PJRT CPU, each forward's graph grew (10, 18, 28, 40, 50, 65 s per forward) where
    with the cut they take 4-16 s, each new shape compiled once."""
    import torch_xla

    torch_xla.sync()


class XlaGraphRunner:
    """`capture(fn) -> (replay, outputs)` over torch-xla's compiled-graph cache.

    compiles: how many captures were taken (one per bucket); XLA's own count is in
    `torch_xla.debug.metrics` (`UncachedCompile`), which the tpu tier's compile test reads.
    """

    pads_on_host = True
    table_width_buckets = True

    def __init__(self):
        self.compiles = 0

    def capture(self, fn):
        """(replay, outputs): run and compile `fn` once; `replay` re-runs it into `outputs`."""
        import torch_xla

        outputs = fn()
        torch_xla.sync()

        def replay():
            fresh = fn()
            _copy_into(outputs, fresh)
            torch_xla.sync()

        replay()            # the replay graph (the step plus the copy into outputs) compiles here too
        self.compiles += 1
        return replay, outputs


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    else:
        raise TypeError(f"XlaGraphRunner: cannot replay into a {type(dst).__name__}")
