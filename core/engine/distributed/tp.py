"""A TP leader's steps to its TP followers over its TP group.

The leader runs the DP rank's LLMEngine; before each forward it broadcasts the step's
ForwardMetadata and row copies (`TPSender.step`), so every follower runs the same forward on its
shard with the same cache rows. A step with images also carries their embedding rows and the
batch rows they replace: the leader runs the vision encoder (replicated, unsharded) and the
followers take its output. Between steps it may send `idle` (a heartbeat, or with expert
parallelism an empty forward that joins the MoE collectives) and at the end `stop`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3.model.metadata import CheckpointMetadata, ForwardMetadata

STOP, STEP, HEARTBEAT, IDLE_FORWARD = 0, 1, 2, 3
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


def receive(group, device) -> tuple[int, tuple | None]:
    """A follower's next command from its TP leader: (STEP, (meta, row copies, media or None)),
    else (HEARTBEAT | IDLE_FORWARD | STOP, None)."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, group=group, group_src=0)
    cmd, max_q_len, t, n, pages, m, c, copies, num_decodes, r, dcode = header.tolist()
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
        elif cmd == IDLE_FORWARD:
            on_idle()
