"""DSpark-style proposer: the draft reads the target's tapped hidden states as context and
drafts a block in one parallel pass, then a Markov head samples it left to right.

Context rows are written as the target commits tokens (`observe`), so the draft never
recomputes them; a request whose context has a gap (its prefix came from the prefix cache, so
the target never tapped it) gets no drafts, which keeps outputs exact and only costs speed.
`draft_sample_method` "probabilistic" samples each Markov step from the request's sampling
transform of the draft logits and keeps that distribution as q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3.checkpoint.loader import load_plain
from k3.engine.sampler import uniform_noise
from k3.model.dspark import DSparkConfig, DSparkDraft

from .ngram import Proposal
from .rejection import target_probs

PAGE = 64
_DRAFT_STREAM = 0xD5A4C


@dataclass
class _Context:
    pages: list[int] = field(default_factory=list)
    observed: int = 0                     # positions [0, observed) hold context rows; -1: a gap


class DSparkProposer:
    """Drafts with a DSpark block draft over the features of the target model `target`'s
    `tap_layers` (the runner taps them in every forward); context pages for max_num_seqs
    requests of max_model_len tokens."""

    def __init__(self, config, *, target, max_model_len: int, max_num_seqs: int):
        t = target.cfg
        cfg = DSparkConfig.from_pretrained(config.model)
        problems = []
        if cfg.vocab_size != t.vocab_size:
            problems.append(f"vocab_size {cfg.vocab_size} != the target's {t.vocab_size}")
        if cfg.hidden_size != t.hidden_size or cfg.target_hidden_size != t.hidden_size:
            problems.append("hidden_size and target_hidden_size must equal the target's (shared embedding)")
        if any(not 0 <= layer < t.num_hidden_layers for layer in cfg.target_layer_ids):
            problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} outside the target's layers")
        if target.parallel.world_size != 1:
            problems.append("the DSpark draft runs with tensor parallel size 1 only")
        if problems:
            raise ValueError("DSpark draft " + str(config.model) + ": " + "; ".join(problems))
        self.cfg, self.target = cfg, target
        self.device = target.lm_head_weight.device
        self.k = min(config.num_speculative_tokens, cfg.block_size)
        self.greedy = config.draft_sample_method == "greedy"
        self.model = DSparkDraft(cfg, dtype=target.dtype, device=self.device)
        load_plain(self.model, config.model)
        self.tap_layers = tuple(cfg.target_layer_ids)
        pages = max_num_seqs * -(-max_model_len // PAGE)
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.pages = [torch.full((pages, PAGE, width), float("nan"), dtype=target.dtype, device=self.device)
                      for _ in range(cfg.num_hidden_layers)]
        self.free = list(range(pages))
        self.seqs: dict[str, _Context] = {}

    # ------------------------------------------------------------------ context
    def observe(self, request, start: int, taps: torch.Tensor) -> None:
        """The target committed tokens [start, start + len(taps)) with these tapped features."""
        ctx = self.seqs.setdefault(request.request_id, _Context())
        end = start + taps.shape[0]
        if ctx.observed < 0 or start > ctx.observed:
            ctx.observed = -1
            return
        while len(ctx.pages) * PAGE < end:
            ctx.pages.append(self.free.pop())
        positions = torch.arange(start, end, device=taps.device)
        rows = self.model.context_rows(taps, positions)
        page = torch.tensor(ctx.pages, device=taps.device)[positions // PAGE]
        for cache, layer_rows in zip(self.pages, rows):
            cache[page, positions % PAGE] = layer_rows
        ctx.observed = max(ctx.observed, end)

    def release(self, request) -> None:
        ctx = self.seqs.pop(request.request_id, None)
        if ctx is not None:
            self.free += ctx.pages

    def accepted(self, request, num_accepted: int) -> None:
        """Nothing to roll back: context rows come only from committed target tokens."""

    # ------------------------------------------------------------------ drafting
    def propose_batch(self, batch: list[tuple]) -> list[Proposal]:
        return [self._propose(request, limit) for request, limit in batch]

    def _propose(self, request, limit: int) -> Proposal:
        ctx = self.seqs.get(request.request_id)
        position = request.num_tokens - 1                       # the anchor: the last sampled token
        if ctx is None or ctx.observed != position:
            return Proposal([])
        target = self.target
        pages = torch.tensor(ctx.pages, device=self.device)
        index = torch.arange(position, device=self.device)
        context = [cache[pages[index // PAGE], index % PAGE] for cache in self.pages]
        base = self.model.base_logits(request.all_token_ids[-1], position, context,
                                      lambda ids: target.model.embed(ids, None),
                                      lambda h: F.linear(h, target.lm_head_weight).float())
        tokens, probs, previous = [], [], request.all_token_ids[-1]
        for j in range(min(self.k, limit)):
            logits = base[j] + self.model.markov_bias(previous).float()
            if self.greedy:
                token = int(logits.argmax())
            else:
                q = target_probs(logits[None], request.params)[0]
                race = -torch.log(uniform_noise(torch.tensor([request.seed ^ _DRAFT_STREAM]),
                                                torch.tensor([len(request.output_token_ids) + j]), q.shape[0]))[0]
                token = int((q.cpu() / race).argmax())
                probs.append(q.cpu())
            tokens.append(token)
            previous = token
        return Proposal(tokens, None if self.greedy else torch.stack(probs))
