"""The batch-invariant forward: a call run as one-token decode steps, one sequence at a time.

Every kernel then sees one problem shape per token (T = N = 1), fixed by the model and the
token's position alone: the same reduction order whatever shares the batch, however the prompt
was chunked, and whether the token was decoded or recomputed in a prefill (a prefill runs the
KDA recurrence token by token and attends through `mla.decode`, exactly as decode does). With
kernels marked batch invariant (`k3.plugin.batch_invariant`: deterministic for given shapes)
a token's logits are then bit-identical across batch compositions, chunk sizes, preemptions
and decode-vs-prefill. What it costs: one forward per token (BENCHMARKS.md,
bench/batch_invariant.py). docs/batch-invariance.md describes the mode.
"""

from __future__ import annotations

import torch

from .metadata import CacheViews, ForwardMetadata, LoRAMetadata


def token_steps(meta: ForwardMetadata, page_size: int) -> list[tuple[int, ForwardMetadata]]:
    """[(packed token index, its one-token DECODE metadata)] in packed order (sequence by
    sequence, each in position order). A step's block table holds only the pages up to its
    position (`page_size`: tokens per block-table entry), so its attention width depends on
    nothing but the position; its logits_indices is [0]. Prefix-cache checkpoints travel with
    their sequence's steps: the KDA layer saves a one-token step's state before it (a checkpoint
    at its position) or after it (at its position + 1), so each checkpoint holds exactly the
    state the token steps reached, and a later prefix hit resumes bit for bit. Reads the
    metadata on the host. Refuses calls that verify drafts (not in this mode)."""
    if meta.spec is not None:
        raise ValueError("the batch-invariant forward does not run speculative verification "
                         "(docs/batch-invariance.md)")
    device = meta.input_ids.device
    cu, context = meta.cu_seqlens.tolist(), meta.context_lens.tolist()
    one_seq = torch.tensor([0, 1], dtype=meta.cu_seqlens.dtype, device=device)
    first = torch.zeros(1, dtype=torch.long, device=device)
    steps = []
    for s in range(meta.num_seqs):
        for t in range(cu[s], cu[s + 1]):
            position = context[s] + t - cu[s]
            pages = position // page_size + 1
            lora = None if meta.lora is None else LoRAMetadata(meta.lora.token_slots[t: t + 1],
                                                               (meta.lora.seq_slots[s],))
            steps.append((t, ForwardMetadata(
                input_ids=meta.input_ids[t: t + 1], positions=meta.positions[t: t + 1], cu_seqlens=one_seq,
                context_lens=meta.context_lens.new_full((1,), position), slot_mapping=meta.slot_mapping[t: t + 1],
                block_table=meta.block_table[s: s + 1, :pages], state_indices=meta.state_indices[s: s + 1],
                logits_indices=first, max_q_len=1, num_decodes=1, lora=lora,
                checkpoints=None if meta.checkpoints is None else meta.checkpoints.rows(slice(s, s + 1)))))
    return steps


@torch.no_grad()
def forward_token_steps(model, meta: ForwardMetadata, cache: CacheViews, *, page_size: int):
    """`model(meta, cache)` as one-token steps (`token_steps`): the same `ForwardOutput`
    fields that a plain forward fills (logits [M, V] at meta.logits_indices, hidden_states
    [T, d]); no taps or per-position KDA states."""
    logits, hidden = {}, []
    wanted = meta.logits_indices.tolist()
    need = set(wanted)
    for t, step in token_steps(meta, page_size):
        if t not in need:                       # no LM head for a prompt token nobody scores
            step.logits_indices = step.logits_indices[:0]
        out = model(step, cache)
        if t in need:
            logits[t] = out.logits
        hidden.append(out.hidden_states)
    if not hidden:
        raise ValueError("forward_token_steps: a call without tokens")
    out.hidden_states = torch.cat(hidden)                                       # [T, d]
    out.logits = torch.cat([logits[t] for t in wanted]) if wanted else out.logits  # [M, V]
    return out
