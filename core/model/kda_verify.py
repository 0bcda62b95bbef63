"""Speculative verification in a KDA layer, and the commit after acceptance.

A verifying sequence runs its 1 + k tokens through the recurrence token by token, but its
running state row is left as it was: the tokens after the first rejection must leave no
trace. What is kept for the commit depends on the rollback strategy:
- "states": the state after every token (recurrent and conv) goes to a row of its own
  (`meta.spec.state_indices`); the commit copies the accepted one into the running row.
- "recover" (RecoverSSM-style): per token only the key, decay, correction and pre-conv input go
  to the record slot (`meta.spec.record_slots`); the commit rebuilds the state in closed form
  (`kda.rebuild_state`) and slides the conv window. About 6/K of a state per token.
Sequences in the same batch that do not speculate are computed and stored as usual,
prefix-cache checkpoints included.
"""

from __future__ import annotations

import torch

from k3.model.metadata import CacheViews, ForwardMetadata


def verified_positions(meta: ForwardMetadata) -> torch.Tensor:
    """[M, 2] (sequence, token) of every token of a verifying sequence: the engine's
    `meta.spec.positions`, else derived from `meta.spec.lens` (one host read)."""
    if meta.spec.positions is not None:
        return meta.spec.positions
    lens = meta.q_lens.long()
    width = int(lens.max())
    j = torch.arange(width, device=lens.device)
    mask = (meta.spec.lens > 0)[:, None] & (j[None, :] < lens[:, None])
    return mask.nonzero()


def verify(mixer, meta: ForwardMetadata, cache: CacheViews, qkv, conv_w, conv_in, s0, g, beta):
    """The KDA recurrence of a VERIFY call; returns (o [T, H, V], None)."""
    k, rows, cu = mixer.kernels, meta.state_indices, meta.cu_seqlens
    view = cache.kda[mixer.kda_index]
    spec = meta.spec.lens > 0                                                   # [N]
    lens = meta.q_lens
    states_mode = meta.spec.state_indices is not None
    emit = {}
    if states_mode:     # the conv window after each token t < S (clamped to the sequence)
        width = meta.spec.state_indices.shape[1]
        offsets = torch.minimum(torch.arange(1, width + 1, device=lens.device)[None, :], lens[:, None])
        emit = {"checkpoint_offsets": offsets}
    conv = k.kda.short_conv(qkv.unsqueeze(0), conv_w, conv_state=conv_in, cu_seqlens=cu, **emit)
    conv_out = conv.state
    q, kk, v = mixer.heads(conv.y)
    args = (q.unsqueeze(0), kk.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0))
    out = k.kda.recurrent(*args, initial_state=s0, cu_seqlens=cu, output_per_position_states=True,
                          output_corrections=True)
    o, s1, states, u = out.o, out.state, out.states, out.corrections
    keep = ~spec                                                                # sequences stored as usual
    view.conv[rows[keep]] = conv_out[keep]
    view.recurrent[rows[keep]] = s1[keep].to(view.recurrent.dtype)
    starts = cu[:-1].long()
    _write_checkpoints(meta, view, qkv, conv_in, s0, states, spec, starts)
    seq, j = verified_positions(meta).unbind(1)                                 # [M] each
    src = starts[seq] + j                                                       # token index in the batch
    if states_mode:
        dest = meta.spec.state_indices[seq, j]
        view.recurrent[dest] = states[0, src].to(view.recurrent.dtype)
        view.conv[dest] = torch.stack(conv.checkpoints, dim=1)[seq, j]             # [N, S, 3P, W-1] -> [M, ...]
    else:
        rec = cache.kda_records[mixer.kda_index]
        longest = int(j.max()) + 1 if seq.numel() else 0    # a host read, in this rollback mode only
        if longest > rec.keys.shape[1]:
            raise ValueError(f"{longest} verified tokens exceed the record slots' {rec.keys.shape[1]}")
        slot = meta.spec.record_slots[seq]
        heads = rec.keys.shape[2]
        # records are kept in the state dtype (float32 for bf16 activations): the recovery replays the
        # recurrence from them in that dtype, as the kernel computed it
        rec.keys[slot, j] = kk[src].repeat_interleave(heads // kk.shape[1], dim=1).to(rec.keys.dtype)
        rec.decays[slot, j] = g[src].to(rec.decays.dtype)
        rec.corrections[slot, j] = u[0, src].to(rec.corrections.dtype)
        rec.qkv[slot, j] = qkv[src].to(rec.qkv.dtype)
    return o[0], None


def _write_checkpoints(meta: ForwardMetadata, view, qkv, conv_in, s0, states, spec, starts) -> None:
    """Prefix-cache checkpoints of the non-speculating sequences in a verify batch (a prompt
    chunk sharing the step with verifying requests): the state and conv window after r of the
    chunk's tokens, from the per-position states the verify pass computed anyway."""
    from .kda import checkpoint_offsets

    found = checkpoint_offsets(meta)
    if found is None:
        return
    offsets, valid, dest = found
    if bool((valid & spec[:, None]).any()):
        raise ValueError("a verifying sequence cannot save prefix-cache checkpoints: its tokens may be rejected")
    window = view.conv.shape[2]                                                 # W - 1
    for n, c in valid.nonzero().tolist():
        r, start = int(offsets[n, c]), int(starts[n])
        state = s0[n] if r == 0 else states[0, start + r - 1]                  # [H, K, V]
        taps = torch.cat([conv_in[n], qkv[start:start + r].transpose(0, 1).to(conv_in.dtype)], dim=1)  # [3P, W-1+r]
        view.recurrent[dest[n, c]] = state.to(view.recurrent.dtype)
        view.conv[dest[n, c]] = taps[:, r:r + window]


def commit_records(mixer, cache: CacheViews, slots: torch.Tensor, rows: torch.Tensor, kept: torch.Tensor) -> None:
    """Rebuild the running rows after `kept` [M] tokens from the records of `slots` [M]."""
    view, rec = cache.kda[mixer.kda_index], cache.kda_records[mixer.kda_index]
    s0 = view.recurrent[rows]
    state = mixer.kernels.kda.rebuild_state(s0, rec.keys[slots], rec.decays[slots], rec.corrections[slots], kept)
    view.recurrent[rows] = state.to(view.recurrent.dtype)
    window = view.conv.shape[2]                                                 # W - 1
    full = torch.cat([view.conv[rows], rec.qkv[slots].transpose(1, 2).to(view.conv.dtype)], dim=2)  # [M, 3P, W-1+L]
    index = kept.long()[:, None] + torch.arange(window, device=rows.device)[None, :]          # [M, W-1]
    view.conv[rows] = full.gather(2, index[:, None, :].expand(-1, full.shape[1], -1))
