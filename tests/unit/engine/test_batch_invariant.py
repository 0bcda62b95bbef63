"""The batch-invariant mode (docs/batch-invariance.md, issue 31 items 1 and 2) on the reference
platform, k3-tiny float32: the kernel marks and the refusal, the conformance case
model.batch_invariance_bitwise (which fails when the runner batches normally), and the
log-probs `k3.LLM` serves in the mode against a teacher-forced prefill recompute, bit for bit."""

from __future__ import annotations

import pytest
import torch

import k3
from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.engine.config import EngineConfig
from k3.platform import BatchInvariantUnsupported, select_platform
from k3.platform import facade
from k3.platform import reference as reference_plugin
from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.platforms.torch_kernels.tables import torch_tables
from k3.plugin import KERNEL_TABLES, is_batch_invariant
from k3.plugin.types import PlatformInfo


def _info(device: str) -> PlatformInfo:
    return PlatformInfo(name="reference", plugin="reference", distribution="k3", version="0", device=device,
                        forced=False)


def test_reference_serves_the_invariant_kernels_marked_on_the_cpu_only():
    cpu = reference_plugin.k3_moe_kernels(platform=_info("cpu"), batch_invariant=True)
    gpu = reference_plugin.k3_moe_kernels(platform=_info("cuda"), batch_invariant=True)
    default = reference_plugin.k3_moe_kernels(platform=_info("cpu"), batch_invariant=False)
    assert all(is_batch_invariant(getattr(cpu, e)) for e in cpu.entries())
    assert cpu.experts.__wrapped__ is invariant_tables()["moe"].experts
    assert not any(is_batch_invariant(getattr(t, e)) for t in (gpu, default) for e in t.entries())
    platform = select_platform("reference", batch_invariant=True)
    assert platform.kernels.batch_invariant
    assert all(is_batch_invariant(getattr(getattr(platform.kernels, t.FAMILY), e))
               for t in KERNEL_TABLES for e in t.entries())
    plain = select_platform("reference")
    assert not plain.kernels.batch_invariant and not is_batch_invariant(plain.kernels.moe.experts)


def test_the_mode_is_refused_naming_the_unmarked_entries(monkeypatch):
    marked = facade.is_batch_invariant
    unmarked = (invariant_tables()["moe"].experts, invariant_tables()["mla"].decode)
    monkeypatch.setattr(facade, "is_batch_invariant",
                        lambda k: marked(k) and getattr(k, "__wrapped__", None) not in unmarked)
    with pytest.raises(BatchInvariantUnsupported) as e:
        select_platform("reference", batch_invariant=True)
    assert set(e.value.entries) == {"moe.experts", "mla.decode"}
    assert "\n" not in str(e.value) and "moe.experts" in str(e.value) and "mla.decode" in str(e.value)


def test_the_mode_refuses_what_it_does_not_run_yet(monkeypatch):
    with pytest.raises(ValueError, match="it does not combine with speculative_config, tensor_parallel_size"):
        EngineConfig(model="m", batch_invariant=True, enable_prefix_caching=True, tensor_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()
    EngineConfig(model="m", batch_invariant=True, enable_prefix_caching=True).validate()     # runs now
    monkeypatch.setenv("K3_BATCH_INVARIANT", "1")
    assert EngineConfig(model="m").batch_invariant and not EngineConfig(model="m", batch_invariant=False).batch_invariant


def _case_item():
    return next(i for i in items("smoke", ("model",)) if i.case.name == "model.batch_invariance_bitwise"
                and i.sample.shape.startswith("k3-tiny_"))


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant_kernels", "default_kernels"])
def test_bitwise_case_passes_and_fails_with_the_default_kernels(invariant, monkeypatch):
    """The case passes in the mode; with the default kernels in their place (marked, the same
    one-path model wiring) its bit equality breaks: the case can tell."""
    if not invariant:
        monkeypatch.setattr(reference_plugin, "invariant_tables", torch_tables)
    outcome = run_item(RunContext(select_platform("reference")), _case_item())
    assert outcome.passed == invariant, outcome.summary()


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    engine = k3.LLM(str(tiny_checkpoint("k3-tiny")), dtype="float32", batch_invariant=True, skip_tokenizer_init=True,
                    kv_cache_memory_gib=0.02, max_num_batched_tokens=8, load_progress=False)
    yield engine
    engine.shutdown()


def test_served_logprobs_equal_a_prefill_recompute_bit_for_bit(llm):
    """Sampled rollouts (three at once, prompts chunked by an 8-token budget) and their
    log-probs, then one batch of teacher-forced prefills over prompt + completion, in another
    composition: every completion token's prompt log-prob equals its served one exactly."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (6, 2, 4)]
    params = [k3.SamplingParams(max_tokens=3, temperature=1.0, seed=s, logprobs=0) for s in range(3)]
    served = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, served)]
    recomputed = llm.generate([{"prompt_token_ids": f} for f in reversed(full)],
                              k3.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[::-1]
    for p, out, again in zip(prompts, served, recomputed):
        tokens = out.outputs[0].token_ids
        got = [again.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(tokens)]
        want = [out.outputs[0].logprobs[j][t] for j, t in enumerate(tokens)]
        assert got == want


def test_a_prefix_cache_hit_is_bit_identical_in_the_mode(tiny_checkpoint):
    """Prefix caching in the mode: the token steps save KDA checkpoints at unit boundaries, so a
    request that resumes from one (and from the cached latent pages) gets exactly the log-probs
    it gets computed from scratch: second requests extending a first one's prompt, against the
    same requests on an engine without caching, in another batch composition."""
    common = dict(dtype="float32", batch_invariant=True, skip_tokenizer_init=True, kv_cache_memory_gib=0.02,
                  max_num_batched_tokens=16, load_progress=False)
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, 384, (130,), generator=g).tolist()                     # one 128-token unit and 2
    seconds = [first + torch.randint(0, 384, (n,), generator=g).tolist() for n in (3, 9)]
    params = k3.SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    cached = k3.LLM(str(tiny_checkpoint("k3-tiny")), enable_prefix_caching=True, **common)
    try:
        cached.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        hits = cached.generate([{"prompt_token_ids": p} for p in seconds], params, use_tqdm=False)
        stats = cached.engine.prefix_cache_stats()
    finally:
        cached.shutdown()
    assert stats["prefix_cache_hits_total"] == 2 and stats["prefix_cache_reused_tokens_total"] == 256, stats
    plain = k3.LLM(str(tiny_checkpoint("k3-tiny")), enable_prefix_caching=False, **common)
    try:
        alone = [plain.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in reversed(seconds)][::-1]
    finally:
        plain.shutdown()
    for hit, want in zip(hits, alone):
        assert hit.outputs[0].token_ids == want.outputs[0].token_ids
        assert hit.outputs[0].logprobs == want.outputs[0].logprobs
