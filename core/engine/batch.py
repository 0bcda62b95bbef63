"""A scheduled step as tensors: the flat ForwardMetadata (with its `spec` and `checkpoints`
sub-records when a request verifies drafts or saves a KDA checkpoint, `lora` when a request runs
on a LoRA adapter) and the sampling
parameters of the requests that sample, built from the requests' row lists on the host and
uploaded in one transfer per dtype (`HostBatch`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from k3.dtypes import legacy_rounding
from k3.model.metadata import CheckpointMetadata, ForwardMetadata, LoRAMetadata, SpecMetadata, leading_one_token_steps

from .padding import HostStep, StepPadding
from .prompt_logprobs import PromptSpan
from .sampler import SamplingBatch
from .scheduler import SchedulerOutput
from .upload import HostBatch


@dataclass
class StepBatch:
    meta: ForwardMetadata
    sample_rows: list[int]         # indices into scheduled of the requests that sample a token
    sample_logits: list[int]       # their rows in the logits (padded steps: then padding rows, to the batch bucket)
    sample_index: torch.Tensor | None  # sample_logits on the device, None when they are rows 0..n-1
    spec_rows: dict[int, slice]    # verifying requests: index into scheduled -> their logits rows
    token_starts: list[int]        # first packed token of each scheduled request (host copy of cu_seqlens)
    token_sources: torch.Tensor | None = None   # [N] lookahead decodes: rows of the previous samples
    prompt_spans: dict[int, PromptSpan] | None = None   # prompt_logprobs: logits rows of prompt positions
    prompt_targets: torch.Tensor | None = None  # [M] the prompt tokens those rows predict, in span order


def build_metadata(out: SchedulerOutput, *, block_size: int, device, pinned: bool = False,
                   token_sources: list[int] | None = None, padding: StepPadding | None = None) -> StepBatch:
    """ForwardMetadata of a scheduled step (logits only for requests that complete; every
    position of a verifying request; every prompt position of a request that asks for prompt
    logprobs). pinned: upload without blocking (HostBatch.upload).
    token_sources: for a step of lookahead decodes, the row of the previous step's samples
    that holds each sequence's input token (uploaded as `StepBatch.token_sources`).
    padding: the platform's static-shape buckets (`k3.engine.padding`): the step is padded to
    them on the host (not a step that verifies drafts), so `meta` has the bucket's shapes."""
    ids, positions, slots, lens, context, logits_at, sample_rows = [], [], [], [], [], [], []
    sample_logits: list[int] = []
    spec_rows: dict[int, slice] = {}
    prompt_spans: dict[int, PromptSpan] = {}
    prompt_targets: list[int] = []
    spec_lens, spec_states, record_slots, spec_positions = [], [], [], []
    max_spec = max(len(s.spec_tokens) for s in out.scheduled)
    max_ckpt = max(len(s.checkpoints) for s in out.scheduled)
    ckpt_pos, ckpt_rows = [], []
    max_rows = max(len(s.request.rows) for s in out.scheduled)
    table = []
    for i, s in enumerate(out.scheduled):
        r, start = s.request, s.request.num_computed_tokens
        tokens = s.tokens
        spec = len(s.spec_tokens)
        spec_lens.append(spec)
        if spec:
            spec_positions += [(i, j) for j in range(len(tokens))]
        spec_states.append((r.spec_rows + [r.state_row] * (1 + max_spec))[: 1 + max_spec])
        record_slots.append(r.record_slot if r.record_slot is not None else 0)
        ids += tokens
        pos = range(start, start + len(tokens))
        positions += pos
        slots += [r.rows[p // block_size] * block_size + p % block_size for p in pos]
        lens.append(len(tokens))
        context.append(start)
        table.append(r.rows + [r.rows[-1]] * (max_rows - len(r.rows)))    # pad with a valid row
        pad = max_ckpt - len(s.checkpoints)
        ckpt_pos.append([p for p, _ in s.checkpoints] + [-1] * pad)
        ckpt_rows.append([row for _, row in s.checkpoints] + [r.state_row] * pad)
        if r.params.prompt_logprobs is not None and not spec:
            # positions start .. P - 2 score prompt tokens start + 1 .. P - 1 (P - 1 samples)
            end = min(start + len(tokens), len(r.prompt_token_ids) - 1)
            if end > start:
                prompt_spans[i] = PromptSpan(len(logits_at), start, end - start)
                prompt_targets += r.prompt_token_ids[start + 1: end + 1]
                first = len(ids) - len(tokens)
                logits_at += range(first, first + end - start)
        if spec:
            spec_rows[i] = slice(len(logits_at), len(logits_at) + len(tokens))
            logits_at += range(len(ids) - len(tokens), len(ids))
        elif s.completes:
            sample_logits.append(len(logits_at))
            logits_at.append(len(ids) - 1)
            sample_rows.append(i)
    # the scheduler puts the decodes first; a one-token prompt chunk is not one (K3_LEGACY_ROUNDING: it was)
    decodes = [n == 1 for n in lens] if legacy_rounding() else [s.decode for s in out.scheduled]
    seq_slots = [s.request.lora_slot for s in out.scheduled]
    state_rows = [s.request.state_row for s in out.scheduled]
    if padding is not None and not max_spec:
        padding.pad(HostStep(ids, positions, slots, lens, context, table, state_rows, logits_at, decodes, seq_slots,
                             ckpt_pos, ckpt_rows))
        if sample_logits:           # the sampler runs at the batch bucket too (`ModelRunner.run`)
            taken = set(sample_logits)
            spare = [i for i in range(len(logits_at)) if i not in taken]
            want = padding.buckets.batch_for(len(sample_logits)) - len(sample_logits)
            sample_logits += (spare + [len(logits_at) - 1] * want)[:want]
        if token_sources is not None:   # lookahead decodes: a padding sequence takes any previous sample
            token_sources = token_sources + [0] * (len(ids) - len(token_sources))
    cu = [0, *itertools.accumulate(lens)]
    host = HostBatch()
    host.add("input_ids", ids, torch.long)
    host.add("positions", positions, torch.long)
    host.add("context_lens", context, torch.long)
    host.add("slot_mapping", slots, torch.long)
    host.add("state_indices", state_rows, torch.long)
    host.add("logits_indices", logits_at, torch.long)
    host.add("cu_seqlens", cu, torch.int32)
    host.add("block_table", table, torch.int32)
    if max_ckpt:
        host.add("checkpoints.positions", ckpt_pos, torch.long)
        host.add("checkpoints.state_indices", ckpt_rows, torch.long)
    if max_spec:
        host.add("spec.lens", spec_lens, torch.int32)
        host.add("spec.positions", spec_positions, torch.long, shape=(len(spec_positions), 2))
        if any(s.request.spec_rows for s in out.scheduled):
            host.add("spec.state_indices", spec_states, torch.long)
        else:
            host.add("spec.record_slots", record_slots, torch.long)
    if sample_logits != list(range(len(sample_logits))):
        host.add("sample_index", sample_logits, torch.long)
    if token_sources is not None:
        host.add("token_sources", token_sources, torch.long)
    if prompt_targets:
        host.add("prompt_targets", prompt_targets, torch.long)
    seq_slots = tuple(seq_slots)
    if any(slot >= 0 for slot in seq_slots):
        host.add("lora.token_slots", [slot for slot, n in zip(seq_slots, lens) for _ in range(n)], torch.long)
    uploaded = host.upload(device, pinned=pinned)
    sample_index = uploaded.pop("sample_index", None)
    sources = uploaded.pop("token_sources", None)
    targets = uploaded.pop("prompt_targets", None)
    spec = _record(uploaded, "spec.", SpecMetadata) if max_spec else None
    checkpoints = _record(uploaded, "checkpoints.", CheckpointMetadata) if max_ckpt else None
    lora = LoRAMetadata(uploaded.pop("lora.token_slots"), seq_slots) if "lora.token_slots" in uploaded else None
    num_decodes = 0 if max_spec else leading_one_token_steps([1 if d else 2 for d in decodes])
    meta = ForwardMetadata(max_q_len=max(lens), num_decodes=num_decodes, spec=spec, checkpoints=checkpoints, lora=lora,
                           max_seq_len=max(c + n for c, n in zip(context, lens)), **uploaded)
    token_starts = cu[: len(out.scheduled)]            # from the host values: no device read
    return StepBatch(meta=meta, sample_rows=sample_rows, sample_logits=sample_logits, sample_index=sample_index,
                     spec_rows=spec_rows, token_starts=token_starts, token_sources=sources,
                     prompt_spans=prompt_spans or None, prompt_targets=targets)


def _record(uploaded: dict, prefix: str, cls):
    """The sub-record `cls` of the uploaded fields named prefix + field (popped)."""
    return cls(**{name[len(prefix):]: uploaded.pop(name) for name in list(uploaded) if name.startswith(prefix)})


def build_sampling(out: SchedulerOutput, rows: list[int], *, vocab_size: int, device,
                   pinned: bool = False) -> SamplingBatch:
    """Per-row sampling tensors for the requests that sample this step."""
    reqs = [out.scheduled[i].request for i in rows]
    params = [r.params for r in reqs]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    all_greedy = all(p.temperature <= 0 for p in params)
    host = HostBatch()
    if not all_greedy:          # a greedy batch takes the argmax alone: no draw parameters to copy
        host.add("temperature", [p.temperature for p in params], torch.float32)
        host.add("top_p", [p.top_p for p in params], torch.float32)
        host.add("min_p", [p.min_p for p in params], torch.float32)
        host.add("top_k", [p.top_k for p in params], torch.long)
        host.add("seeds", [r.seed for r in reqs], torch.long)
        host.add("steps", [out.scheduled[i].output_index for i in rows], torch.long)   # the noise counter
    biased = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if biased:                  # sparse on the host, in the same (pinned) upload; dense on the device
        host.add("bias.rows", [row for row, _, _ in biased], torch.long)
        host.add("bias.ids", [t for _, t, _ in biased], torch.long)
        host.add("bias.values", [float(b) for _, _, b in biased], torch.float32)
    uploaded = host.upload(device, pinned=pinned)
    bias = None
    if biased:
        bias = torch.zeros(len(reqs), vocab_size, dtype=torch.float32, device=device)
        bias.index_put_((uploaded.pop("bias.rows"), uploaded.pop("bias.ids")), uploaded.pop("bias.values"))
    batch = SamplingBatch(
        all_greedy=all_greedy,
        filters_off=all(p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 for p in params),
        num_logprobs=max((p.logprobs or 0) for p in params),
        logit_bias=bias,
        **uploaded,
    )
    if any(p.uses_penalties for p in params):
        counts = torch.zeros(len(reqs), vocab_size, dtype=torch.int32, device=device)
        prompt = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=device)
        for i, r in enumerate(reqs):
            if r.output_token_ids:
                counts[i].index_add_(0, tensor(r.output_token_ids, torch.long),
                                     torch.ones(len(r.output_token_ids), dtype=torch.int32, device=device))
            prompt[i, tensor(r.prompt_token_ids, torch.long)] = True
        batch.token_counts, batch.prompt_mask = counts, prompt
        batch.repetition_penalty = tensor([p.repetition_penalty for p in params], torch.float32)
        batch.presence_penalty = tensor([p.presence_penalty for p in params], torch.float32)
        batch.frequency_penalty = tensor([p.frequency_penalty for p in params], torch.float32)
    masks = [p.allowed_tokens(r.output_token_ids) if p.allowed_tokens else None for p, r in zip(params, reqs)]
    if any(m is not None for m in masks):
        allowed = torch.ones(len(reqs), vocab_size, dtype=torch.bool, device=device)
        for i, m in enumerate(masks):
            if m is not None:
                allowed[i] = False
                allowed[i, tensor(list(m), torch.long)] = True
        batch.allowed = allowed
    return batch
