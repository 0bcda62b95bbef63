"""Driving a whole model like an engine for the end-to-end cases: batched requests, chunked
prefill mixed with decode steps, greedy or teacher-forced continuations, shuffled pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.cache.plan import row_layout
from k3.cache.pool import CachePool
from k3.checkpoint.random_init import random_checkpoint
from k3.checkpoint.writer import write_checkpoint
from k3.config import K3Config
from k3.model.metadata import CacheViews, ForwardMetadata

from .inputs import poison_freed_memory

PAGE_SIZE = 16


@dataclass
class Request:
    """prompt token ids; forced: the continuation to feed (teacher forcing), None = greedy."""

    prompt: list[int]
    forced: list[int] | None = None


@dataclass
class Trace:
    """What one request saw: its generated tokens and the logits [steps, V] (float64, CPU) each
    was chosen from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.logits)


def tiny_checkpoint(workdir: Path, preset: str, seed: int = 0) -> Path:
    """A random checkpoint of a tiny preset, written once per directory."""
    out = Path(workdir) / f"{preset}-seed{seed}"
    if not (out / "config.json").exists():
        cfg = K3Config.preset(preset)
        write_checkpoint(out, cfg, random_checkpoint(cfg, seed=seed), max_shard_bytes=256 * 1024)
    return out


def prompts(seed: int, lengths: list[int], vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


_CACHE_DTYPES = {torch.float64: ("float64", "fp64"), torch.float32: ("float32", "fp32"),
                 torch.bfloat16: ("bfloat16", "bf16")}


def packed_cache(platform, model, num_rows: int) -> CacheViews:
    """The engine's cache for `model`: one packed CachePool of `num_rows` rows of PAGE_SIZE
    tokens, allocated by the platform (`k3_allocate_cache`), KDA state rows in the platform's
    layout (`k3_kda_state_layout`), every view row-strided as the engine hands them to kernels."""
    act, latent = _CACHE_DTYPES[model.dtype]
    tp = model.parallel.world_size
    layout = row_layout(model.cfg, block_size=PAGE_SIZE, tensor_parallel_size=tp, kv_cache_dtype=latent,
                        index_cache_dtype="fp8", activation_dtype=act, alignment=platform.cache_alignment)
    return CachePool.on_platform(platform, model.cfg, layout, num_rows, activation_dtype=act, kv_cache_dtype=latent,
                                 index_cache_dtype="fp8", tensor_parallel_size=tp).views


def run(model, requests: list[Request], *, steps: int, chunk: int | None, slots: list[int], device="cpu",
        seed: int = 0, platform=None, graph_buckets: list[int] | None = None) -> list[Trace]:
    """Generate `steps` tokens for every request, all in one batch.

    Each call feeds every unfinished request either its next prompt chunk (`chunk` tokens;
    None: the whole prompt) or its last token, so prefill chunks and decode steps share
    batches; a call where every request decodes is a pure decode step. Requests use state row
    slots[i] and pages from a seeded shuffle of the pool. With `platform`, the cache is the
    engine's packed pool allocated by that platform (state rows first, then pages), else
    separate contiguous tensors per layer (`model.allocate_cache`). With `graph_buckets` (and a
    platform), pure decode steps replay graphs captured by the platform's `k3_graph_runner`
    (`k3.engine.graphs.DecodeGraphs`, padding on one extra row after the pages).
    """
    n = len(requests)
    pages_each = -(-max(len(r.prompt) + steps for r in requests) // PAGE_SIZE)
    rows = max(slots) + 1
    perm = torch.randperm(rows * pages_each, generator=torch.Generator().manual_seed(seed))
    table = perm.view(rows, pages_each).to(torch.int32)
    if platform is None:
        cache = model.allocate_cache(num_state_rows=rows, num_pages=rows * pages_each, page_size=PAGE_SIZE,
                                     device=device)
    else:                   # one row space: state rows 0..rows-1, pages after them (then graph padding)
        scratch = rows + rows * pages_each
        cache = packed_cache(platform, model, scratch + (1 if graph_buckets else 0))
        table = table + rows
    graphs = None
    if graph_buckets:
        from k3.engine.graphs import DecodeGraphs

        graphs = DecodeGraphs(model, cache, platform.graph_runner, buckets=graph_buckets, scratch_row=scratch,
                              block_size=PAGE_SIZE, max_pages=pages_each, device=device, progress=False)
    fed = [0] * n                                       # prompt tokens fed so far
    traces = [Trace() for _ in range(n)]
    while True:
        active = [i for i in range(n) if len(traces[i].tokens) < steps]
        if not active:
            return traces
        pieces, context = [], []
        for i in active:
            prompt = requests[i].prompt
            if fed[i] < len(prompt):
                take = len(prompt) - fed[i] if chunk is None else min(chunk, len(prompt) - fed[i])
                pieces.append(prompt[fed[i]: fed[i] + take])
            else:
                pieces.append([traces[i].tokens[-1]])
            context.append(fed[i] + len(traces[i].tokens) - (0 if fed[i] < len(prompt) else 1))
        # one-token steps first, as the engine's scheduler orders them (ForwardMetadata.num_decodes)
        order = sorted(range(len(active)), key=lambda r: len(pieces[r]) != 1)
        active, pieces, context = ([xs[r] for r in order] for xs in (active, pieces, context))
        meta = ForwardMetadata.build(pieces, context_lens=context, state_indices=[slots[i] for i in active],
                                     block_table=table[[slots[i] for i in active]], page_size=PAGE_SIZE,
                                     device=device)
        poison_freed_memory(device)
        with torch.no_grad():
            if graphs is not None and graphs.covers(meta):
                logits = graphs.run(meta).double().cpu()
            else:
                logits = model(meta, cache).logits.detach().double().cpu()  # [len(active), V]
        for row, i in enumerate(active):
            prompt = requests[i].prompt
            if fed[i] < len(prompt):
                fed[i] += len(pieces[row])
                if fed[i] < len(prompt):
                    continue                            # mid-prompt chunk: no token yet
            trace = traces[i]
            trace.logits.append(logits[row])
            forced = requests[i].forced
            trace.tokens.append(forced[len(trace.tokens)] if forced else int(logits[row].argmax()))


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """[steps] top-1 minus top-2 logit of each row of [steps, V]."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]
