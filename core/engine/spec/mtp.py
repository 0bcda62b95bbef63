"""MTP proposer: drafts with the checkpoint's own MTP layer (`k3.model.mtp`), vLLM's "mtp" method.

The MTP layer keeps its own attention cache: the row at position p comes from (token p + 1, the
target's pre-norm final hidden state at p), which the runner taps in every forward
(`FINAL_HIDDEN`). A row needs the token after its position, so the positions of a forward whose
next token is not appended yet (the last sampled token's, and the accepted drafts') wait as
pending features and are written, batched over the requests, when the proposer next runs.

Drafting a request whose last sampled token sits at position n - 1: the MTP output at n - 2 (it
read token n - 1) gives draft 1; draft j + 1 feeds draft j and the MTP's own output back at
position n - 2 + j (a chained step, one batched forward over the drafting requests per step).
Those rows are provisional: the next observation overwrites them with the target's features.
Every draft step uses MTP layer 0; further MTP layers of a checkpoint are not loaded. A request
whose features have a gap (its prefix came from the prefix cache, so the target never computed
those positions) gets no drafts: outputs stay exact, it only loses speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.cache.block_pool import BlockPool
from k3.cache.format import CacheFormat
from k3.cache.pool import CachePool
from k3.checkpoint.loader import CheckpointError, load_checkpoint, shard_files
from k3.checkpoint.names import canonical_name
from k3.checkpoint.shard_file import open_shard
from k3.model.metadata import ForwardMetadata
from k3.model.model import FINAL_HIDDEN
from k3.model.mtp import OWN_EMBED, OWN_HEAD, MTPLayer, mtp_cache_config

from .config import SpeculativeConfigError
from .drafting import draw_drafts
from .ngram import Proposal

_DRAFT_STREAM = 0x3A7F1


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    written: int = 0                      # MTP rows valid for positions [0, written); -1: a gap
    pending: list[torch.Tensor] = field(default_factory=list)   # target features of [written, tapped)
    tapped: int = 0
    last: torch.Tensor | None = None      # the MTP output [d] at position written - 1


def mtp_cache_format(cfg, cache_format: CacheFormat, *, platform, activation_dtype) -> CacheFormat:
    """The MTP layer's own cache format: the target's record dtypes and block size over
    `mtp_cache_config(cfg)` (one MLA layer, no KDA state)."""
    return CacheFormat.build(mtp_cache_config(cfg), activation_dtype=activation_dtype,
                             kv_cache_dtype=cache_format.kv_cache_dtype,
                             index_cache_dtype=cache_format.index_cache_dtype, block_size=cache_format.block_size,
                             platform=platform)


def target_cache_share(cache_bytes: int, cfg, cache_format: CacheFormat, *, platform, activation_dtype) -> int:
    """The target's part of `cache_bytes` when the MTP cache comes out of the same budget.

    The MTP cache holds as many pages as the target has token rows (plus a few per request), so
    the budget splits in the ratio of the two row sizes. Without this the target plans the whole
    budget (on an accelerator: what the weights leave) and the MTP cache's allocation fails."""
    target_row = cache_format.layout(cfg).row_bytes
    mtp_row = mtp_cache_format(cfg, cache_format, platform=platform,
                               activation_dtype=activation_dtype).layout(mtp_cache_config(cfg)).row_bytes
    return cache_bytes * target_row // (target_row + mtp_row)


class MTPProposer:
    """Drafts k tokens per request with the MTP layer of the target checkpoint (`model_dir`, or
    the speculative config's `model`), for the target model `target`; its cache pages hold up to
    `num_rows` x block_size positions over all requests."""

    tap_layers = (FINAL_HIDDEN,)

    def __init__(self, config, *, target, platform, cache_format: CacheFormat, model_dir, num_rows: int):
        cfg = target.cfg
        source = config.model or model_dir
        if cfg.num_nextn_predict_layers < 1:
            raise SpeculativeConfigError(f"speculative method 'mtp' needs MTP layers, but {source} has none "
                                         "(num_nextn_predict_layers = 0); use 'ngram', 'draft_model' or 'dspark'")
        if target.parallel.world_size != 1:
            raise SpeculativeConfigError("the MTP draft runs with tensor parallel size 1 only")
        self.k = config.num_speculative_tokens
        self.greedy = config.draft_sample_method == "greedy"
        self.target, self.device = target, torch.device(platform.info.device)
        own = _own_tensors(source, cfg)
        self.layer = MTPLayer(cfg, 0, kernels=target.kernels, parallel=target.parallel, dtype=target.dtype,
                              device=self.device, own_embed=OWN_EMBED in own, own_head=OWN_HEAD in own)
        load_checkpoint(self.layer, source, progress=False, part="mtp")
        self.layer.block.self_attn.fold_weights()
        cache_cfg = mtp_cache_config(cfg)
        fmt = mtp_cache_format(cfg, cache_format, platform=platform, activation_dtype=target.dtype)
        self.block = fmt.block_size
        self.cache = CachePool.on_platform(platform, cache_cfg, fmt, num_rows)
        self.pool = BlockPool(num_rows)
        self.seqs: dict[str, _Seq] = {}

    # ------------------------------------------------------------------ features
    def observe(self, request, start: int, taps: torch.Tensor) -> None:
        """The target computed positions [start, start + len(taps)) with these final hidden states."""
        seq = self.seqs.setdefault(request.request_id, _Seq())
        if seq.written < 0:
            return
        if start < seq.tapped:                        # recomputed (preemption): keep the rows before start
            seq.written = seq.tapped = min(seq.written, start)
            seq.pending, seq.last = [], None
        if start > seq.tapped:                        # positions the target did not compute here: a gap
            self._gap(seq)
            return
        seq.pending.append(taps)
        seq.tapped = start + taps.shape[0]
        known = len(request.all_token_ids) - 1        # positions p < known have their next token
        self._write([(request, seq)], upto=[min(known, seq.tapped)])

    def _gap(self, seq: _Seq) -> None:
        seq.written, seq.pending, seq.last = -1, [], None

    def _write(self, items: list[tuple], upto: list[int]) -> None:
        """Write the MTP rows of each (request, seq)'s pending positions [written, upto), one
        batched forward; keeps each one's last output."""
        todo = [(r, s, end) for (r, s), end in zip(items, upto)
                if end > s.written >= 0 and self._pages([s], [end])]
        if not todo:
            return
        pieces, hidden = [], []
        for request, seq, end in todo:
            feats = torch.cat(seq.pending)                                   # [tapped - written, d]
            n = end - seq.written
            pieces.append(request.all_token_ids[seq.written + 1: end + 1])
            hidden.append(feats[:n])
            seq.pending = [feats[n:]] if n < feats.shape[0] else []
        x = self._forward([s for _, s, _ in todo], pieces, torch.cat(hidden))
        cu = 0
        for (_, seq, end), piece in zip(todo, pieces):
            cu += len(piece)
            seq.written, seq.last = end, x[cu - 1]

    # ------------------------------------------------------------------ the MTP forward
    def _pages(self, seqs: list[_Seq], ends: list[int]) -> bool:
        """Pages for positions [0, end) of each seq; False (and a gap for those that did not get
        them) when the pool is full."""
        ok = True
        for seq, end in zip(seqs, ends):
            need = -(-end // self.block) - len(seq.pages)
            if need > 0:
                rows = self.pool.allocate(need)
                if rows is None:
                    self._gap(seq)
                    ok = False
                    continue
                seq.pages += rows
        return ok

    def _forward(self, seqs: list[_Seq], pieces: list[list[int]], hidden: torch.Tensor,
                 context: list[int] | None = None) -> torch.Tensor:
        """One MTP forward over each seq's piece of next-token ids at positions from its
        `context` (default: its written rows); hidden [sum(len(piece)), d] the previous states.
        Returns the MTP outputs [sum(len(piece)), d]."""
        width = max(len(s.pages) for s in seqs)
        table = torch.tensor([s.pages + [s.pages[-1]] * (width - len(s.pages)) for s in seqs], dtype=torch.int32)
        meta = ForwardMetadata.build(pieces, context_lens=context or [s.written for s in seqs],
                                     state_indices=[0] * len(seqs), block_table=table, page_size=self.block,
                                     device=self.device)
        with torch.no_grad():
            return self.layer(meta.input_ids, hidden.to(self.device), meta, self.cache.views,
                              embed=lambda ids: self.target.model.embed(ids, None), decode=meta.max_q_len == 1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.layer.logits(x, self.target.lm_head_weight)

    # ------------------------------------------------------------------ drafting
    def propose_batch(self, batch: list[tuple]) -> list[Proposal]:
        if not batch:
            return []
        seqs = [self.seqs.get(r.request_id) for r, _ in batch]
        flush = [(r, s) for (r, _), s in zip(batch, seqs) if s is not None and s.written >= 0 and s.pending]
        self._write(flush, upto=[min(len(r.all_token_ids) - 1, s.tapped) for r, s in flush])
        ready = [i for i, ((r, _), s) in enumerate(zip(batch, seqs))
                 if s is not None and s.written >= 0 and s.written == r.num_tokens - 1 and s.last is not None]
        proposals = [Proposal([]) for _ in batch]
        if not ready:
            return proposals
        requests = [batch[i][0] for i in ready]
        limits = [batch[i][1] for i in ready]
        active = [seqs[i] for i in ready]
        steps = max(limits)
        x = torch.stack([s.last for s in active])                            # [N, d]: outputs at n - 2
        drafts: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        for j in range(steps):
            tokens, q = draw_drafts(self._logits(x), requests, j, greedy=self.greedy, stream=_DRAFT_STREAM)
            for i, token in enumerate(tokens):
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q[i].cpu())
            if j + 1 == steps:
                break
            # chained step: draft j at position n - 1 + j, fed with the MTP output at n - 2 + j
            context = [r.num_tokens - 1 + j for r in requests]
            if not self._pages(active, [c + 1 for c in context]):
                break
            x = self._forward(active, [[t] for t in tokens], x, context=context)
        for i, limit in zip(ready, limits):
            n = ready.index(i)
            proposals[i] = Proposal(drafts[n][:limit], None if self.greedy else torch.stack(probs[n][:limit]))
        return proposals

    def accepted(self, request, num_accepted: int) -> None:
        """Nothing to roll back: rows past the accepted length are rewritten by the next observation."""

    def release(self, request) -> None:
        seq = self.seqs.pop(request.request_id, None)
        if seq is not None and seq.pages:
            self.pool.free(seq.pages)


def _own_tensors(model_dir, cfg) -> set[str]:
    """Which of the optional `embed_tokens` / `shared_head.head` MTP layer 0 carries itself."""
    layer = f"model.layers.{cfg.num_hidden_layers}."
    found = set()
    for path in shard_files(Path(model_dir)):
        with open_shard(path, CheckpointError) as f:
            for key in f.keys():
                name = canonical_name(key, cfg, "mtp").template
                if name.startswith(layer) and name[len(layer):] in (OWN_EMBED, OWN_HEAD):
                    found.add(name[len(layer):])
    return found
