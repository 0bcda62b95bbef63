"""model.batch_invariance_bitwise: the batch-invariant mode (docs/batch-invariance.md) holds
bit for bit on the platform.

The platform is resolved again in the mode (`select_platform(name, batch_invariant=True)`:
only kernels it marks batch invariant); a platform that refuses the mode skips the case with
its refusal (which names the entries). On tiny random checkpoints, through the engine's
ModelRunner in the mode:

1. the target request alone, its whole prompt in one call, generates greedily: its logits at
   every generated token are the reference of what follows;
2. the same request (teacher-forced to those tokens) shares seeded random batches with two
   companions, each call feeding every request a random chunk (1 to 4 tokens) of what it has
   left, other state rows and pages, and is preempted once (recomputed from scratch in a fresh
   state row and fresh pages, its prompt plus the tokens so far, as the scheduler's preemption
   by recompute does): its logits and log-probs must equal (1)'s bit for bit (`torch.equal`,
   no tolerance);
3. decode vs prefill: one teacher-forced prefill over prompt + generated tokens (logits at
   every position) must give, at the positions that were decoded, (1)'s logits bit for bit:
   what an RL trainer recomputes.
"""

from __future__ import annotations

import random

import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_checkpoint
from k3.config import K3Config
from k3.engine.runner import ModelRunner
from k3.model.metadata import ForwardMetadata
from k3.platform import BatchInvariantUnsupported, select_platform

from .. import compare as cmp
from ..driver import prompts, tiny_checkpoint
from ..inputs import TORCH_DTYPES
from ..registry import Case, Sample, register

PRESETS = ("k3-tiny", "k3.1-pro-tiny")
STEPS, MAX_CHUNK, LENGTHS = 3, 4, [9, 3, 4]         # target, companions
PREEMPT_AFTER = 1                                    # generated tokens before the target is preempted
PAGE = 4                                             # tokens per block: the target spans three pages


def _invariant_model(ctx, preset: str, dtype: torch.dtype):
    """(platform in the mode, its model) or pytest.skip with the platform's refusal."""
    key = ("batch-invariant-model", preset, dtype)
    if key not in ctx.cache:
        try:
            platform = select_platform(ctx.platform.name, batch_invariant=True)
        except BatchInvariantUnsupported as e:
            ctx.cache[key] = e
        else:
            path = tiny_checkpoint(ctx.workdir, preset)
            model = platform.build_model(K3Config.from_pretrained(path), dtype=dtype)
            load_checkpoint(model, path, progress=False)
            platform.process_weights(model)
            ctx.cache[key] = (platform, model)
    found = ctx.cache[key]
    if isinstance(found, BatchInvariantUnsupported):
        import pytest   # only a conformance run reaches this (k3 imports without pytest: the conformance extra)

        pytest.skip(str(found))
    return found


class _Pool:
    """A cache pool and a runner in the mode: `rows` state rows, then shuffled pages."""

    def __init__(self, platform, model, device, *, rows: int, pages_each: int, seed: int):
        perm = torch.randperm(rows * pages_each, generator=torch.Generator().manual_seed(seed))
        self.tables = perm.view(rows, pages_each).to(torch.int32) + rows
        pool = CachePool.for_model(model, rows * (1 + pages_each), block_size=PAGE, platform=platform,
                                   device=device)
        self.device = device
        self.runner = ModelRunner(model, pool, block_size=PAGE, vocab_size=model.cfg.vocab_size, device=device,
                                  batch_invariant=True, step_end=platform.step_end)

    def forward(self, pieces, context, slots, *, all_logits=False) -> torch.Tensor:
        order = sorted(range(len(pieces)), key=lambda r: len(pieces[r]) != 1)     # one-token steps first
        meta = ForwardMetadata.build([pieces[r] for r in order], context_lens=[context[r] for r in order],
                                     state_indices=[slots[r] for r in order], block_table=self.tables[[slots[r] for r in order]],
                                     page_size=PAGE, all_logits=all_logits, device=self.device)
        logits = self.runner.forward(meta).logits.detach().cpu()
        if all_logits:
            return logits
        back = [0] * len(order)
        for row, r in enumerate(order):
            back[r] = row
        return logits[back]


def _generate(pool: _Pool, requests: list[list[int]], forced: list[int] | None, *, steps: int, max_chunk: int | None,
              seed: int, preempt: int | None = None) -> list[torch.Tensor]:
    """The logits [V] at each of request 0's generated tokens (forced to `forced`, or greedy);
    the others greedy. max_chunk None: whole prompts in one call. preempt: request 0 is
    recomputed from scratch in a spare state row (the last) after that many tokens."""
    rng = random.Random(seed)
    n = len(requests)
    seqs = [list(p) for p in requests]
    cached, generated = [0] * n, [0] * n
    slots = list(range(n))
    target: list[torch.Tensor] = []
    while True:
        active = [i for i in range(n) if generated[i] < steps]
        if not active:
            return target
        pieces = []
        for i in active:
            left = len(seqs[i]) - cached[i]
            take = left if max_chunk is None else min(left, rng.randint(1, max_chunk))
            pieces.append(seqs[i][cached[i]: cached[i] + take])
        logits = pool.forward(pieces, [cached[i] for i in active], [slots[i] for i in active])
        for row, i in enumerate(active):
            cached[i] += len(pieces[row])
            if cached[i] < len(seqs[i]):
                continue                                # mid-prompt chunk: no token yet
            if i == 0:
                target.append(logits[row])
            token = forced[generated[0]] if i == 0 and forced else int(logits[row].argmax())
            seqs[i].append(token)
            generated[i] += 1
            if i == 0 and generated[0] == preempt:      # preemption by recompute: fresh row and pages
                slots[0], cached[0] = n, 0


def _bitwise(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> cmp.OutputResult:
    """Logits and their log-probs equal bit for bit (torch.equal), step by step."""
    for step, (g, w) in enumerate(zip(got, want)):
        for what, a, b in (("logits", g, w), ("log-probs", torch.log_softmax(g, -1), torch.log_softmax(w, -1))):
            if not torch.equal(a, b):
                differ = int((a != b).sum())
                return cmp.OutputResult(name, "exact", False, differ / a.numel(), float((a - b).abs().max()),
                                        message=f"step {step}: {differ} of {a.numel()} {what} differ")
    if len(got) != len(want):
        return cmp.OutputResult(name, "exact", False, message=f"{len(got)} steps, expected {len(want)}")
    return cmp.OutputResult(name, "exact", True, 0.0, 0.0)


def _run(ctx, item):
    preset, dtype, seed = item.sample.params["preset"], TORCH_DTYPES[item.dtype], item.seed % 1000
    platform, model = _invariant_model(ctx, preset, dtype)
    prompt, *companions = prompts(seed, LENGTHS)
    pages_each = -(-(max(LENGTHS) + STEPS) // PAGE)
    kw = dict(device=ctx.device, pages_each=pages_each)
    alone_pool = _Pool(platform, model, rows=1, seed=seed, **kw)
    alone = _generate(alone_pool, [prompt], None, steps=STEPS, max_chunk=None, seed=seed)
    tokens = [int(row.argmax()) for row in alone]
    batch_pool = _Pool(platform, model, rows=len(LENGTHS) + 1, seed=seed + 1, **kw)
    batched = _generate(batch_pool, [prompt, *companions], tokens, steps=STEPS, max_chunk=MAX_CHUNK, seed=seed,
                        preempt=PREEMPT_AFTER)
    recompute_pool = _Pool(platform, model, rows=1, seed=seed + 2, **kw)
    full = recompute_pool.forward([prompt + tokens[:-1]], [0], [0], all_logits=True)        # [len, V]
    prefilled = list(full[len(prompt) - 1:])
    notes = [f"{STEPS} tokens; batch of {len(LENGTHS)}, chunks 1..{MAX_CHUNK}, preempted after {PREEMPT_AFTER}"]
    return cmp.Outcome([_bitwise("batched_vs_alone", batched, alone), _bitwise("prefill_vs_decode", prefilled, alone)],
                       notes)


register(Case(
    "model.batch_invariance_bitwise", "model", "model.batch_invariance_bitwise", run=_run,
    dtypes=("float32", "bfloat16"), smoke_dtype="float32",
    samples=tuple(Sample(f"{p}_prompts{'-'.join(map(str, LENGTHS))}_chunks1-{MAX_CHUNK}_gen{STEPS}_preempt{PREEMPT_AFTER}",
                         params={"preset": p}) for p in PRESETS),
    doc="In the batch-invariant mode a request's logits equal bit for bit alone, in random batches with random "
        "chunks and a preemption, and in a prefill recompute."))
