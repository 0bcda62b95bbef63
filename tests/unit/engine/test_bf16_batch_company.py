"""Greedy bf16 output does not depend on batch company beyond near-ties (issue 32 item 1), on the
reference platform through `k3.LLM`: 12 prompts generated alone, then the same 12 among 28
others (other batch sizes, other positions in the batch, mixed prefill and decode steps). In a
rounding dtype a batch of another size may round elsewhere, so outputs may split, but only where
the two best tokens were within bf16's batch-company margin (conformance's
`model.batch_invariance`, 2.0 logits): every first divergence is checked against the top-two
log-prob gap the lone run saw at that step. Once with prefix caching on (prompts sharing a
prefix: cached and computed rows mixed), once with n-gram speculation (verify steps of k + 1
tokens a sequence), the two settings in which the issue's adversarial run saw the most splits."""

import random

import pytest

import k3
from k3.config import K3Config
from k3.conformance.cases.model import MARGINS

MARGIN = MARGINS["bfloat16"]
TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(32)
    shared = [rng.randrange(10, vocab) for _ in range(12)]                     # a common system prefix
    own = [[rng.randrange(10, vocab) for _ in range(rng.randrange(4, 28))] for _ in range(40)]
    return [shared + p if i % 2 else p for i, p in enumerate(own)]


def _first_divergence(alone, crowded) -> tuple[int, float] | None:
    """(step, the lone run's top-two log-prob gap there) of the first differing token, or None."""
    a, c = alone.outputs[0], crowded.outputs[0]
    for step, (x, y) in enumerate(zip(a.token_ids, c.token_ids)):
        if x != y:
            best = sorted(a.logprobs[step].values(), reverse=True)
            return step, best[0] - best[1]
    assert len(a.token_ids) == len(c.token_ids) == TOKENS
    return None


@pytest.mark.parametrize("settings", [{"enable_prefix_caching": True},
                                      {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
                         ids=["prefix_caching", "ngram"])
def test_bf16_greedy_splits_only_at_near_ties(tiny_checkpoint, settings):
    llm = k3.LLM(str(tiny_checkpoint("k3-tiny")), platform="reference", dtype="bfloat16", max_num_seqs=48,
                 skip_tokenizer_init=True, load_progress=False, **settings)
    prompts = _prompts(K3Config.preset("k3-tiny").vocab_size)
    params = k3.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    as_inputs = lambda ps: [{"prompt_token_ids": p} for p in ps]  # noqa: E731
    alone = [llm.generate(as_inputs([p]), params, use_tqdm=False)[0] for p in prompts[:12]]
    crowded = llm.generate(as_inputs(prompts), params, use_tqdm=False)[:12]
    splits = [(i, d) for i, (a, c) in enumerate(zip(alone, crowded)) if (d := _first_divergence(a, c))]
    wide = [(i, step, round(gap, 3)) for i, (step, gap) in splits if gap > MARGIN]
    assert not wide, (f"greedy bf16 tokens changed with batch company at top-two gaps above {MARGIN} "
                      f"(prompt, step, gap): {wide}; all splits: {splits}")
