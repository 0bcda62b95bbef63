"""Driving a whole model like an engine for the end-to-end cases: batched requests, chunked
prefill mixed with decode steps, greedy or teacher-forced continuations, shuffled pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.cache.pool import CachePool
from k3.engine.graphs import DecodeGraphs
from k3.engine.runner import ModelRunner
from k3.checkpoint.random_init import random_checkpoint
from k3.checkpoint.writer import write_checkpoint
from k3.config import K3Config
from k3.model.metadata import ForwardMetadata

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


def run(model, requests: list[Request], *, steps: int, chunk: int | None, slots: list[int], device="cpu",
        seed: int = 0, platform=None, graph_buckets: list[int] | None = None) -> list[Trace]:
    """Generate `steps` tokens for every request, all in one batch.

    Each call feeds every unfinished request either its next prompt chunk (`chunk` tokens;
    None: the whole prompt) or its last token, so prefill chunks and decode steps share
    batches; a call where every request decodes is a pure decode step. Requests use state row
    slots[i] and pages from a seeded shuffle of the pool. The cache is the engine's packed pool
    (state rows first, then pages), allocated by `platform` (`k3_allocate_cache`, its KDA state
    layout) or, without one, on `device`; the model runs through the engine's ModelRunner. With
    `graph_buckets` (and a platform), pure decode steps replay graphs captured by the platform's
    `k3_graph_runner` (`k3.engine.graphs.DecodeGraphs`, padding on one extra row after the pages).
    With a platform, the runner calls its `k3_step_end` after every forward, as the engine does.
    With graphs, every call where each sequence brings one token must have replayed one (else
    RuntimeError: model.graph_decode would compare eager decode with itself).
    """
    n = len(requests)
    pages_each = -(-max(len(r.prompt) + steps for r in requests) // PAGE_SIZE)
    rows = max(slots) + 1
    perm = torch.randperm(rows * pages_each, generator=torch.Generator().manual_seed(seed))
    table = perm.view(rows, pages_each).to(torch.int32) + rows
    # one row space: state rows 0..rows-1, pages after them (then graph padding)
    scratch = rows + rows * pages_each
    pool = CachePool.for_model(model, scratch + (1 if graph_buckets else 0), block_size=PAGE_SIZE, platform=platform,
                               device=device)
    graphs = None
    if graph_buckets:
        graphs = DecodeGraphs(model, pool.views, platform.graph_runner, buckets=graph_buckets, scratch_row=scratch,
                              block_size=PAGE_SIZE, max_pages=pages_each, device=device, progress=False)
    runner = ModelRunner(model, pool, block_size=PAGE_SIZE, vocab_size=model.cfg.vocab_size, device=device,
                         graphs=graphs, step_end=None if platform is None else platform.step_end)
    fed = [0] * n                                       # prompt tokens fed so far
    traces = [Trace() for _ in range(n)]
    one_token_steps = 0                                 # calls where every sequence brings one token
    while True:
        active = [i for i in range(n) if len(traces[i].tokens) < steps]
        if not active:
            if graphs is not None and (graphs.replays != one_token_steps or not one_token_steps):
                raise RuntimeError(f"{one_token_steps} one-token steps but {graphs.replays} replayed a captured "
                                   "decode graph: the graph runner was bypassed")
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
        one_token_steps += all(len(p) == 1 for p in pieces)
        poison_freed_memory(device)
        with torch.no_grad():
            logits = runner.forward(meta).logits.detach().double().cpu()    # [len(active), V]
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
