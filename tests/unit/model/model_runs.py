"""Drive a K3ForCausalLM the way the engine does, on the engine's cache and runner: prompts in
chunks, then token by token, over a small packed CachePool (state rows first, pages after them)."""

from __future__ import annotations

import torch

from k3.cache.pool import CachePool
from k3.engine.runner import ModelRunner
from k3.model import K3ForCausalLM, contiguous_block_table
from k3.model.metadata import ForwardMetadata, LoRAMetadata

PAGE_SIZE = 16


def teacher_forced(model: K3ForCausalLM, prompts: list[list[int]], *, chunk: int | None = None,
                   slots: list[int] | None = None, first: int | None = None,
                   adapters: list[int] | None = None, **cache_options) -> list[torch.Tensor]:
    """Logits of every position of every prompt, fed `chunk` tokens per sequence per call
    (None: all at once; 1: pure decode steps after the first token), sequences batched.
    first: the first call's tokens per sequence (a prefill before `chunk`-token steps).
    adapters: a LoRA slot per prompt (-1: the base model). cache_options: the pool's formats
    (`CacheFormat.build`'s kv_cache_dtype, index_cache_dtype)."""
    n = len(prompts)
    slots = slots or list(range(n))
    pages, states = -(-max(map(len, prompts)) // PAGE_SIZE), max(slots) + 1
    cache = CachePool.for_model(model, states * (1 + pages), block_size=PAGE_SIZE, **cache_options)
    runner = ModelRunner(model, cache, block_size=PAGE_SIZE, vocab_size=model.cfg.vocab_size, device="cpu")
    table = contiguous_block_table(states, pages) + states
    done = [0] * n
    logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i in range(n) if done[i] < len(prompts[i])]
        size = [first if first is not None and done[i] == 0 else chunk or len(prompts[i]) for i in active]
        pieces = [prompts[i][done[i]: done[i] + n] for i, n in zip(active, size)]
        batch = ForwardMetadata.build(pieces, context_lens=[done[i] for i in active],
                                      state_indices=[slots[i] for i in active],
                                      block_table=table[[slots[i] for i in active]], page_size=PAGE_SIZE,
                                      all_logits=True)
        if adapters is not None and any(adapters[i] >= 0 for i in active):
            lora = tuple(adapters[i] for i in active)
            batch.lora = LoRAMetadata(torch.tensor([s for s, p in zip(lora, pieces) for _ in p]), lora)
        out = runner.forward(batch).logits
        at = 0
        for i, piece in zip(active, pieces):
            logits[i].extend(out[at: at + len(piece)])
            at += len(piece)
            done[i] += len(piece)
    return [torch.stack(rows) for rows in logits]
