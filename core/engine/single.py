"""The single-request reference loop behind `k3 generate`: prefill, then one token per step.

It reads and writes the same flat batch metadata and cache tensors the engine will, with one
state slot and contiguous pages. No batching, no preemption: the serving engine does that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from k3.model import K3ForCausalLM, contiguous_block_table
from k3.model.metadata import ForwardMetadata
from k3.reference.sampling import sample

PAGE_SIZE = 64


@dataclass
class SamplingOptions:
    """Per-request sampling; temperature 0 is greedy. `stop_token_ids` end the output (the
    token itself is not part of the text)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)


@dataclass
class StepResult:
    token: int
    finished: str | None     # None, "stop" (a stop token) or "length" (max_tokens / context)


class SingleSequenceGenerator:
    """Generates for one prompt at a time on `model` (any platform the model runs on)."""

    def __init__(self, model: K3ForCausalLM, *, device=None):
        self.model, self.device = model, device

    def generate(self, prompt_ids: Sequence[int], options: SamplingOptions) -> Iterator[StepResult]:
        cfg = self.model.cfg
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        limit = cfg.max_position_embeddings
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
        max_len = min(limit, len(prompt_ids) + options.max_tokens)
        pages = -(-max_len // PAGE_SIZE)
        cache = self.model.allocate_cache(num_state_rows=1, num_pages=pages, page_size=PAGE_SIZE, device=self.device)
        table = contiguous_block_table(1, pages, device=self.device)
        generator = None
        if options.seed is not None:
            generator = torch.Generator(device=self.device or "cpu").manual_seed(options.seed)
        tokens, context = list(prompt_ids), 0
        stop_ids = set(options.stop_token_ids)
        for step in range(max_len - len(prompt_ids)):
            meta = ForwardMetadata.build([tokens[context:]], context_lens=[context], state_indices=[0],
                                       block_table=table, page_size=PAGE_SIZE, device=self.device)
            logits = self.model(meta, cache).logits
            token = int(sample(logits, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p,
                               min_p=options.min_p, generators=[generator])[0])
            context = len(tokens)
            tokens.append(token)
            if token in stop_ids:
                yield StepResult(token, "stop")
                return
            last = step == max_len - len(prompt_ids) - 1
            yield StepResult(token, "length" if last else None)
