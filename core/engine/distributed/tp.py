"""A TP leader's steps to its TP followers over its TP group.

The leader runs the DP rank's LLMEngine; before each forward it broadcasts the step's
ForwardMetadata and row copies (`TPSender.step`), so every follower runs the same forward on its
shard with the same cache rows. Images: before such a step the leader sends the patches of the
images to encode (`TPSender.encode`) and every rank takes part in the encoder run
(`tp_encode`): with `mm_encoder_tp_mode` "weights" each runs every image through its shard of
the tower (heads and MLP columns, summed over the ranks: k3.vision.tensor_parallel); with "data"
each encodes every TP-size-th image with its whole tower and the outputs are all-gathered. The
step then carries the embedding rows it uses and the batch rows they replace. Between steps it may send `idle` (a heartbeat, or with expert
parallelism an empty forward that joins the MoE collectives) and at the end `stop`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3.model.metadata import CheckpointMetadata, ForwardMetadata

STOP, STEP, HEARTBEAT, IDLE_FORWARD, ENCODE = 0, 1, 2, 3, 4
_FIELDS = ("input_ids", "positions", "cu_seqlens", "context_lens", "slot_mapping", "state_indices", "logits_indices")
_HEADER = 11
_MEDIA_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class TPSender:
    """The TP leader's side (a no-op without followers)."""

    def __init__(self, group, device, size: int):
        self.group, self.device, self.size = group, device, size

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, group=self.group, group_src=0)

    def _command(self, cmd: int) -> None:
        if self.size > 1:
            header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
            header[0] = cmd
            self._broadcast(header)

    def stop(self) -> None:
        self._command(STOP)

    def idle(self, forward: bool = False) -> None:
        """A step without tokens: a heartbeat, or (forward) an empty forward that joins the
        expert-parallel collectives of the DP ranks that have work."""
        self._command(IDLE_FORWARD if forward else HEARTBEAT)

    def encode(self, tower, patches: torch.Tensor, grids: list[tuple[int, int]], mode: str) -> list[torch.Tensor]:
        """The leader's side of an encoder run over the TP ranks: tower.encode(patches, grids) in
        `mode` "weights" or "data" (module docstring)."""
        if self.size == 1:
            return tower.encode(patches, grids)
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        header[:4] = torch.tensor([ENCODE, len(grids), patches.shape[-1], _MEDIA_DTYPES.index(patches.dtype)])
        self._broadcast(header)
        self._broadcast(torch.tensor([x for hw in grids for x in hw], dtype=torch.long, device=self.device))
        self._broadcast(patches.to(self.device).contiguous())
        return tp_encode(tower, patches, grids, self.group, self.size, 0, mode)

    def step(self, meta: ForwardMetadata, row_copies=(), media=None) -> None:
        """media: (image embedding rows [R, d], batch rows [R]) of the step, or None."""
        if self.size == 1:
            return
        device = self.device
        n, pages = meta.block_table.shape
        c = 0 if meta.checkpoints is None else meta.checkpoints.positions.shape[1]
        r, d, code = 0, 0, 0
        if media is not None:
            (r, d), code = media[0].shape, _MEDIA_DTYPES.index(media[0].dtype)
        header = torch.tensor([STEP, meta.max_q_len, meta.num_tokens, n, pages, meta.logits_indices.shape[0], c,
                               len(row_copies), meta.num_decodes, r, d * len(_MEDIA_DTYPES) + code], device=device)
        self._broadcast(header)
        parts = [getattr(meta, f).long().flatten() for f in _FIELDS] + [meta.block_table.long().flatten()]
        if c:
            parts += [meta.checkpoints.positions.flatten(), meta.checkpoints.state_indices.flatten()]
        parts.append(torch.tensor([x for pair in row_copies for x in pair], dtype=torch.long, device=device))
        if media is not None:
            parts.append(media[1].long())
        self._broadcast(torch.cat([p.to(device) for p in parts]))
        if media is not None:
            self._broadcast(media[0].to(device).contiguous())


def tp_encode(tower, patches: torch.Tensor, grids: list[tuple[int, int]], group, size: int, rank: int,
              mode: str) -> list[torch.Tensor]:
    """Every image's embeddings on every rank: "weights" runs them all through this rank's shard
    of the tower (its row-parallel sums are the group's collectives), "data" encodes this rank's
    share with the whole tower and all-gathers (`encode_share`)."""
    if mode == "weights":
        return tower.encode(patches, grids)
    return encode_share(tower, patches, grids, group, size, rank)


def encode_share(tower, patches: torch.Tensor, grids: list[tuple[int, int]], group, size: int,
                 rank: int) -> list[torch.Tensor]:
    """Encode images rank, rank + size, ... of `grids` and all-gather every rank's outputs: the
    embeddings of every image, in order, on every rank."""
    chunks = patches.split([h * w for h, w in grids])
    share = [[i for i in range(len(grids)) if i % size == r] for r in range(size)]
    mine = share[rank]
    outs = tower.encode(torch.cat([chunks[i] for i in mine]) if mine else patches[:0], [grids[i] for i in mine])
    tokens = [tower.tokens_for_grid(h, w) for h, w in grids]
    rows = max(sum(tokens[i] for i in s) for s in share)
    d = tower.cfg.text_hidden_size
    local = torch.zeros(rows, d, dtype=patches.dtype, device=patches.device)
    if outs:
        flat = torch.cat(outs)
        local[: flat.shape[0]] = flat
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    result: list = [None] * len(grids)
    for r, indices in enumerate(share):
        at = 0
        for i in indices:
            result[i] = gathered[r][at: at + tokens[i]]
            at += tokens[i]
    return result


def _follow_encode(engine, group, header: list[int]) -> None:
    """A follower's part of `TPSender.encode`."""
    count, patch, code = header[1], header[2], header[3]
    grids_flat = torch.empty(2 * count, dtype=torch.long, device=engine.device)
    dist.broadcast(grids_flat, group=group, group_src=0)
    pairs = grids_flat.tolist()
    grids = list(zip(pairs[0::2], pairs[1::2]))
    patches = torch.empty(sum(h * w for h, w in grids), 3, patch, patch, dtype=_MEDIA_DTYPES[code],
                          device=engine.device)
    dist.broadcast(patches, group=group, group_src=0)
    tp_encode(engine.media.tower, patches, grids, group, dist.get_world_size(group), dist.get_rank(group),
              engine.media.tp_mode)


def receive(group, device) -> tuple[int, tuple | None]:
    """A follower's next command from its TP leader: (STEP, (meta, row copies, media or None)),
    (ENCODE, header values), else (HEARTBEAT | IDLE_FORWARD | STOP, None)."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, group=group, group_src=0)
    cmd, max_q_len, t, n, pages, m, c, copies, num_decodes, r, dcode = header.tolist()
    if cmd == ENCODE:
        return cmd, header.tolist()
    if cmd != STEP:
        return cmd, None
    sizes = [t, t, n + 1, n, t, n, m, n * pages, n * c, n * c, 2 * copies, r]
    payload = torch.empty(sum(sizes), dtype=torch.long, device=device)
    dist.broadcast(payload, group=group, group_src=0)
    parts = payload.split(sizes)
    fields = dict(zip(_FIELDS, parts[:7]))
    fields["cu_seqlens"] = fields["cu_seqlens"].int()
    meta = ForwardMetadata(block_table=parts[7].view(n, pages).int(), max_q_len=max_q_len, num_decodes=num_decodes,
                           **fields)
    if c:
        meta.checkpoints = CheckpointMetadata(parts[8].view(n, c), parts[9].view(n, c))
    pairs = parts[10].tolist()
    media = None
    if r:
        d, code = divmod(dcode, len(_MEDIA_DTYPES))
        rows = torch.empty(r, d, dtype=_MEDIA_DTYPES[code], device=device)
        dist.broadcast(rows, group=group, group_src=0)
        media = (rows, parts[11])
    return STEP, (meta, list(zip(pairs[0::2], pairs[1::2])), media)


def follow(engine, group, on_idle) -> None:
    """A TP follower's loop: run every step its leader sends (on_idle: an empty forward) until
    `stop`."""
    while True:
        cmd, step = receive(group, engine.device)
        if cmd == STOP:
            return
        if cmd == STEP:
            engine.runner.forward(*step)
        elif cmd == ENCODE:
            _follow_encode(engine, group, step)
        elif cmd == IDLE_FORWARD:
            on_idle()
