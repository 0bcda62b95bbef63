"""Trainer and rollout (issue 31 item 4), k3-tiny float32 on the reference platform: `k3.LLM` in
the batch-invariant mode serves sampled completions on a LoRA adapter (beside a base-model
request) with their log-probs; a trainer-side forward, wired by hand (its own model on the
platform's batch-invariant kernels, its own adapter slots, cache and metadata, one prefill
forward over prompt + completion, the mode's log-normaliser), recomputes those log-probs equal bit
for bit; the float64 model with the adapter merged into its weights (W + scale B A, read by
`lora_files`, default kernels, one batched prefill) agrees with both within tolerance."""

from __future__ import annotations

import torch

import k3
from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_checkpoint, load_model
from k3.config import K3Config
from k3.engine.sampler import log_normaliser
from k3.lora import LoRARegistry
from k3.model.lora import attach_lora
from k3.model.metadata import ForwardMetadata, LoRAMetadata
from k3.platform import select_platform

from lora_files import merge_adapter, write_adapter
from model_runs import teacher_forced

RANK, PAGE = 4, 16


def _trainer_logprobs(ckpt, adapter, sequence: list[int], start: int) -> list[float]:
    """The trainer: log-probs (logit - logsumexp, fp32) of sequence[start:] given what precedes."""
    platform = select_platform("reference", batch_invariant=True)
    model = platform.build_model(K3Config.from_pretrained(ckpt), dtype=torch.float32)
    load_checkpoint(model, ckpt, progress=False)
    slot = LoRARegistry(attach_lora(model, max_loras=1, max_rank=RANK, dtype=torch.float32, device="cpu")).load(
        "policy", adapter).slot
    pages = -(-len(sequence) // PAGE)
    pool = CachePool.for_model(model, 1 + pages, block_size=PAGE)
    inputs = sequence[:-1]
    meta = ForwardMetadata.build([inputs], context_lens=[0], state_indices=[0],
                                 block_table=torch.arange(1, 1 + pages)[None], page_size=PAGE, all_logits=True)
    meta.lora = LoRAMetadata(torch.full((len(inputs),), slot, dtype=torch.long), (slot,))
    logits = model(meta, pool.views).logits.float()                                          # [L - 1, V]
    lp = logits - log_normaliser(logits, batch_invariant=True)[:, None]
    return [lp[i - 1, sequence[i]].item() for i in range(start, len(sequence))]


def test_trainer_recomputes_rollout_logprobs_bit_for_bit(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("k3-tiny")
    adapter = write_adapter(tmp_path / "policy", load_model(ckpt, dtype=torch.float32, progress=False), rank=RANK,
                            seed=5, std=0.2)
    g = torch.Generator().manual_seed(7)
    prompt, other = (torch.randint(0, 384, (n,), generator=g).tolist() for n in (7, 3))
    llm = k3.LLM(str(ckpt), dtype="float32", batch_invariant=True, enable_lora=True, max_loras=1,
                 max_lora_rank=RANK, lora_modules={"policy": str(adapter)}, skip_tokenizer_init=True,
                 kv_cache_memory_gib=0.02, max_num_batched_tokens=8, load_progress=False)
    try:
        params = [k3.SamplingParams(max_tokens=3, temperature=1.0, seed=11, logprobs=0, lora_name="policy"),
                  k3.SamplingParams(max_tokens=3, temperature=1.0, seed=12, logprobs=0)]
        out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    tokens = out.outputs[0].token_ids
    served = [out.outputs[0].logprobs[j][t] for j, t in enumerate(tokens)]
    sequence = prompt + tokens

    trainer = _trainer_logprobs(ckpt, adapter, sequence, len(prompt))
    assert trainer == served                                    # bit for bit, not a tolerance

    merged = load_model(ckpt, dtype=torch.float64, progress=False)
    merge_adapter(merged, adapter)
    lp64 = torch.log_softmax(teacher_forced(merged, [sequence[:-1]])[0], dim=-1)
    independent = torch.tensor([lp64[i - 1, sequence[i]].item() for i in range(len(prompt), len(sequence))],
                               dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(served, dtype=torch.float64), independent, rtol=0, atol=2e-4)
    base = torch.log_softmax(teacher_forced(load_model(ckpt, dtype=torch.float64, progress=False),
                                            [sequence[:-1]])[0], dim=-1)
    effect = max(abs(base[i - 1, sequence[i]].item() - v) for i, v in zip(range(len(prompt), len(sequence)), independent))
    assert effect > 1e-3, "the adapter must change the log-probs for the comparison to mean anything"
