"""Decode steps replayed from captured graphs, one per batch-size bucket.

A platform that can capture (`k3_graph_runner`, e.g. CUDA graphs on nvidia) removes the
per-kernel launch cost of a decode step, which dominates at small batches. At start-up one
step is captured per bucket on static metadata tensors; a later pure-decode step of N
sequences copies its metadata into the smallest bucket B >= N and replays. The B - N padding
sequences are fresh one-token sequences on a scratch row the engine reserves for them: their
KDA state starts from zero, their one latent is written into and read from the scratch row's
first page slot, and their logits are dropped, so they never touch a real request's rows.

A captured step reads a block table as wide as the bucket's: the model's longest sequence
(`max_pages`) by default, which costs nothing where the attention kernels stop at each
sequence's length (nvidia's). A runner whose decode attention costs the table's width instead
(torch kernels over gathered, masked pages: ppu, tpu) sets `table_width_buckets`; then each batch
bucket also has graphs at narrower context bounds (`context_buckets`: 256 tokens, x4 each, up to
max_pages' tokens), and a step replays the narrowest that holds its longest sequence. A bound
is in tokens, not pages, because a K3 page is large (it holds one KDA state row: 32,768 tokens
for k3-slice): its graph's metadata carries it (`ForwardMetadata.context_bound`), its table is
the pages that hold it, and under one page the model reads each page's first `bound` slots
(`k3.model.paging.bounded_pages`). Start-up captures each bucket at the narrowest bound only; a
wider one (the full width included) is captured the first time a step needs it (a one-off
capture of a few steps' time, logged), so start-up pays neither the time nor the memory of
bounds no batch reaches: a full-width step of gathered pages is the largest a bucket has (at 64
sequences of a 32,768-token page, gigabytes a layer), the likeliest to run out of memory beside
an expert cache (the 2026-12-05 H200 run with it decoded without graphs; its capture error was
not recorded then). A late capture that fails (memory taken by the cache since)
leaves that (bucket, bound) to run eagerly, logged once; the other graphs keep replaying.
`precompile_bounds` (`--precompile-context-bounds`) captures every bound of every bucket at
start-up instead: nothing is captured (on XLA: compiled) mid-serving.

Everything else (prefill and mixed steps, speculative verification, prefix checkpoints,
tapped layers for drafts, batches over the largest bucket) runs eagerly, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from tqdm import tqdm

from k3.log import get_logger
from k3.model.metadata import ForwardMetadata, ForwardMode

logger = get_logger(__name__)

BOUND_FIRST_TOKENS = 256      # the narrowest context bound
BOUND_FACTOR = 4              # each context bound this many times the one before


def default_buckets(max_num_seqs: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then multiples of 8, up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def context_buckets(max_tokens: int, *, first_tokens: int = BOUND_FIRST_TOKENS,
                    factor: int = BOUND_FACTOR) -> list[int]:
    """Context bounds (tokens) to capture at for a runner with `table_width_buckets`:
    `first_tokens`, times `factor` each, below max_tokens (the widest table's), then max_tokens."""
    bounds, bound = [], max(1, first_tokens)
    while bound < max_tokens:
        bounds.append(bound)
        bound *= factor
    return bounds + [max_tokens]


def is_plain_decode(meta: ForwardMetadata) -> bool:
    """One new token per sequence, no LoRA adapter row, and nothing but logits asked for."""
    return (meta.mode is ForwardMode.DECODE and meta.checkpoints is None and meta.lora is None
            and meta.num_tokens == meta.num_seqs and meta.logits_indices.shape[0] == meta.num_seqs)


class DecodeGraphs:
    """Captured decode steps for a model and its cache (see the module docstring).

    model: called as model(meta, views, tap_layers=()) -> result with `.logits` [N, V].
    views: the CacheViews every step reads and writes.
    runner: the platform's capturer (`capture(fn) -> (replay, outputs)`).
    scratch_row: a cache row no request owns (padding sequences write and read only it).
    max_pages: the widest block table (the longest sequence's pages), every bucket's width
        unless the runner sets `table_width_buckets` (then also `context_buckets`' narrower
        context bounds, each with the table of the pages that hold it).
    precompile_bounds: capture every context bound at start-up (else the narrowest only).
    """

    def __init__(self, model, views, runner, *, buckets: Sequence[int], scratch_row: int, block_size: int,
                 max_pages: int, device, progress: bool = True, precompile_bounds: bool = False):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"graph batch sizes must be positive, got {list(buckets)}")
        self.model, self.views, self.runner = model, views, runner
        self.buckets = sorted(set(int(b) for b in buckets))
        self.scratch_row, self.block_size, self.max_pages = scratch_row, block_size, max_pages
        self.max_tokens = max_pages * block_size
        self.bounded = bool(getattr(runner, "table_width_buckets", False))
        self.bounds = context_buckets(self.max_tokens) if self.bounded else [self.max_tokens]
        self.device = torch.device(device)
        # per (batch bucket, context bound in tokens): the tensors its graph reads, their values
        # when no sequence is real, and its replay
        self._static: dict[tuple[int, int], ForwardMetadata] = {}
        self._padding: dict[tuple[int, int], ForwardMetadata] = {}
        self._replay: dict[tuple[int, int], tuple] = {}
        self.eager: set[tuple[int, int]] = set()          # (bucket, bound) whose late capture failed
        self.replays = 0                                  # decode steps run from a captured graph
        self.eager_steps = 0                              # covered steps run eagerly (a failed late capture)
        self.late_captures = 0                            # wider graphs captured when first needed
        start_bounds = self.bounds if precompile_bounds else self.bounds[:1]
        keys = [(b, bound) for b in sorted(self.buckets, reverse=True) for bound in start_bounds]
        for b, bound in tqdm(keys, desc="capturing decode graphs", unit="graph", file=sys.stderr,
                             disable=not progress):
            self._capture(b, bound)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def table_pages(self, bound: int) -> int:
        """The block-table width (pages) of a graph at context bound `bound` tokens."""
        return min(self.max_pages, -(-bound // self.block_size))

    def covers(self, meta: ForwardMetadata) -> bool:
        return (is_plain_decode(meta) and meta.num_seqs <= self.max_batch
                and meta.block_table.shape[1] <= self.max_pages)

    def _padding_metadata(self, b: int, bound: int | None = None) -> ForwardMetadata:
        """Metadata of b padding sequences at context bound `bound` tokens (the full width when
        None): every tensor a bucket's replay reads."""
        dev = self.device
        bound = bound or self.max_tokens
        return ForwardMetadata(
            input_ids=torch.zeros(b, dtype=torch.long, device=dev),
            positions=torch.zeros(b, dtype=torch.long, device=dev),
            cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(b, dtype=torch.long, device=dev),
            slot_mapping=torch.full((b,), self.scratch_row * self.block_size, dtype=torch.long, device=dev),
            block_table=torch.full((b, self.table_pages(bound)), self.scratch_row, dtype=torch.int32, device=dev),
            state_indices=torch.full((b,), self.scratch_row, dtype=torch.long, device=dev),
            logits_indices=torch.arange(b, dtype=torch.long, device=dev),
            max_q_len=1, num_decodes=b, context_bound=bound if self.bounded else None,
        )

    def _capture(self, b: int, bound: int) -> None:
        key = (b, bound)
        self._padding[key] = self._padding_metadata(b, bound)
        meta = self._static[key] = self._padding_metadata(b, bound)
        views = self.views

        def step():
            return self.model(meta, views, tap_layers=()).logits

        with torch.no_grad():
            self._replay[key] = self.runner.capture(step)

    _ROWS = ("input_ids", "positions", "context_lens", "slot_mapping", "state_indices")

    @classmethod
    def _fill_on_host(cls, static: ForwardMetadata, pad: ForwardMetadata, meta: ForwardMetadata, n: int,
                      table: torch.Tensor | None = None) -> None:
        """Pad the step's metadata to the bucket on the host, then one whole-bucket upload per
        tensor: for a runner that traces (XLA), where copying n rows on the device would compile
        one graph per batch size. Reads the step's metadata back to the host first (small).
        table: the step's block table cut to the graph's pages (meta's when None)."""
        table = meta.block_table if table is None else table
        for name in cls._ROWS:
            full = getattr(pad, name).cpu()         # device data, no graph: a plain transfer
            full[:n] = getattr(meta, name).cpu()
            getattr(static, name).copy_(full.to(static.input_ids.device))
        padded = pad.block_table.cpu()
        padded[:n, : table.shape[1]] = table.cpu()
        static.block_table.copy_(padded.to(static.block_table.device))

    def _capture_late(self, b: int, bound: int) -> bool:
        """Capture bucket b at a wider context bound when a step first needs it. False when the
        capture failed: that (bucket, bound) then runs eagerly from now on."""
        logger.info(f"capturing the decode graph of batch bucket {b} at {bound} tokens "
                    f"({self.table_pages(bound)} pages) on first use")
        try:
            self._capture(b, bound)
        except Exception as e:
            for table in (self._static, self._padding, self._replay):
                table.pop((b, bound), None)
            self.eager.add((b, bound))
            logger.warning(f"decode graph capture of batch bucket {b} at {bound} tokens failed "
                           f"({type(e).__name__}: {e}); its steps run eagerly from now on")
            return False
        self.late_captures += 1
        return True

    def run(self, meta: ForwardMetadata) -> torch.Tensor:
        """Logits [N, V] of a covered decode step (a fresh tensor: the next replay reuses the
        captured output)."""
        n, pages = meta.num_seqs, meta.block_table.shape[1]
        b = next(size for size in self.buckets if size >= n)
        # the longest sequence: the builder's host count, else all the table's positions
        longest = meta.max_seq_len if meta.max_seq_len is not None else pages * self.block_size
        bound = next((t for t in self.bounds if t >= longest), self.max_tokens)
        if (b, bound) in self.eager or ((b, bound) not in self._replay and not self._capture_late(b, bound)):
            self.eager_steps += 1
            return self.model(meta, self.views, tap_layers=()).logits
        static = self._static[b, bound]
        pad = self._padding[b, bound]                   # the rows past n return to padding
        cols = static.block_table.shape[1]
        table = meta.block_table[:, :cols]              # pages past the bound's hold no position it reads
        if n == b and table.shape[1] == cols:
            for name in self._ROWS:                     # padded by the engine already (`k3.engine.padding`)
                getattr(static, name).copy_(getattr(meta, name))
            static.block_table.copy_(table)
        elif getattr(self.runner, "pads_on_host", False):
            self._fill_on_host(static, pad, meta, n, table)
        else:
            for name in self._ROWS:
                dst = getattr(static, name)
                dst.copy_(getattr(pad, name))
                dst[:n].copy_(getattr(meta, name))
            static.block_table.copy_(pad.block_table)
            static.block_table[:n, : table.shape[1]].copy_(table)
        replay, logits = self._replay[b, bound]
        replay()
        self.replays += 1
        return logits[:n].clone()
