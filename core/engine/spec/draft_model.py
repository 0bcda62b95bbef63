"""Draft-model proposer: a separate small K3-architecture checkpoint with the same tokenizer.

The draft keeps its own packed cache. Per verify step, for every speculating request it
catches up on the tokens it has not seen (the accepted drafts and the last sampled token, one
batched forward), then decodes k - 1 more steps, drafting k tokens. Its KDA state after each
processed input is saved to a scratch row, so after verification it resumes from the state at
the accepted length (the "states" rollback, applied to the draft). `draft_sample_method`
"greedy" drafts argmaxes (one-hot q); "probabilistic" samples from the draft's distribution
under the request's sampling transform and returns those distributions as q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3.cache.block_pool import BlockPool
from k3.cache.format import CacheFormat
from k3.cache.plan import draft_cache_rows
from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_checkpoint
from k3.config import K3Config
from k3.model.metadata import ForwardMetadata

from .drafting import draw_drafts
from .ngram import Proposal

_DRAFT_STREAM = 0xD4AF7


@dataclass
class _DraftSeq:
    rows: list[int] = field(default_factory=list)       # attention rows
    state_row: int | None = None
    scratch: list[int] = field(default_factory=list)     # state after each drafted input
    computed: int = 0                                    # tokens whose draft KV/state is valid
    proposed_from: int = 0                               # tokens at the last proposal


class DraftModelProposer:
    """Drafts with a separate small model (see the module docstring) for the target model
    `target`, its cache in the target's record formats (`cache_format`) at its own block size."""

    tap_layers = ()                 # it reads no target features

    def __init__(self, config, *, target, platform, cache_format, max_model_len: int, max_num_seqs: int):
        self.k = config.num_speculative_tokens
        self.greedy = config.draft_sample_method == "greedy"
        cfg = K3Config.from_pretrained(config.model)
        if cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size}) differs from the target's "
                             f"({target.cfg.vocab_size}): a draft must share the tokenizer")
        self.device = torch.device(platform.info.device)
        self.model = platform.build_model(cfg, dtype=target.dtype, parallel=target.parallel)
        load_checkpoint(self.model, config.model, progress=False)
        fmt = CacheFormat.for_model(self.model, kv_cache_dtype=cache_format.kv_cache_dtype, platform=platform)
        self.block = fmt.block_size
        num_rows = draft_cache_rows(fmt, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    num_speculative_tokens=self.k)
        self.cache = CachePool.on_platform(platform, cfg, fmt, num_rows)
        self.pool = BlockPool(num_rows)
        self.seqs: dict[str, _DraftSeq] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _seq(self, request) -> _DraftSeq:
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = _DraftSeq()
            rows = self._allocate(1 + self.k)
            seq.state_row, seq.scratch = rows[0], rows[1:]
        return seq

    def _allocate(self, n: int) -> list[int]:
        rows = self.pool.allocate(n)
        if rows is None:
            raise RuntimeError("the draft model's cache is full (it is sized for max_num_seqs max-length requests)")
        return rows

    def release(self, request) -> None:
        seq = self.seqs.pop(request.request_id, None)
        if seq is not None:
            self.pool.free(seq.rows + [seq.state_row] + seq.scratch)

    # ------------------------------------------------------------------ drafting
    def _forward(self, seqs: list[_DraftSeq], pieces: list[list[int]]) -> torch.Tensor:
        """One batched draft forward; returns each sequence's last-position logits."""
        for seq, piece in zip(seqs, pieces):
            need = math.ceil((seq.computed + len(piece)) / self.block) - len(seq.rows)
            if need > 0:
                seq.rows += self._allocate(need)
        width = max(len(s.rows) for s in seqs)
        table = torch.tensor([s.rows + [s.rows[-1]] * (width - len(s.rows)) for s in seqs], dtype=torch.int32)
        meta = ForwardMetadata.build(pieces, context_lens=[s.computed for s in seqs],
                                     state_indices=[s.state_row for s in seqs], block_table=table,
                                     page_size=self.block, device=self.device)
        logits = self.model(meta, self.cache.views).logits
        for seq, piece in zip(seqs, pieces):
            seq.computed += len(piece)
        return logits

    def propose_batch(self, batch: list[tuple]) -> list[Proposal]:
        if not batch:
            return []
        requests = [r for r, _ in batch]
        seqs = [self._seq(r) for r in requests]
        steps = max(limit for _, limit in batch)
        pieces = [r.all_token_ids[s.computed:] for r, s in zip(requests, seqs)]
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        logits = self._forward(seqs, pieces)
        for j in range(steps):
            for seq in seqs:                   # the state after the input just processed
                self.cache.copy_row(seq.state_row, seq.scratch[j])
            tokens, q = draw_drafts(logits, requests, j, greedy=self.greedy, stream=_DRAFT_STREAM)
            for i, token in enumerate(tokens):
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q[i])
            if j + 1 < steps:
                logits = self._forward(seqs, [[t] for t in tokens])
        for (r, limit), seq in zip(batch, seqs):
            seq.proposed_from = r.num_tokens
        return [Proposal(d[:limit], None if self.greedy else torch.stack(p[:limit]).cpu())
                for (_, limit), d, p in zip(batch, drafts, probs)]

    def accepted(self, request, num_accepted: int) -> None:
        """Resume the draft at the accepted length: the state after input j = min(n, k - 1)."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            return
        j = min(num_accepted, seq.computed - seq.proposed_from)
        self.cache.copy_row(seq.scratch[j], seq.state_row)
        seq.computed = seq.proposed_from + j
