"""--speculative-config parsing, and the exactness of verification: greedy semantics and the
preserved sampling distribution."""

import math

import pytest
import torch

from k3.engine.params import SamplingParams
from k3.engine.spec.config import SpeculativeConfig, SpeculativeConfigError
from k3.engine.spec.rejection import target_probs, verify


def test_parse_vllm_shape_and_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.draft_sample_method, c.kda_rollback) == (1, 4, "greedy", "states")
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "/x", "num_speculative_tokens": 5,
                                 "draft_sample_method": "probabilistic", "kda_rollback": "recover"})
    assert c.kda_rollback == "recover" and SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize("value,key", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "attention_backend": "X"}', "attention_backend"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "kda_rollback": "replay"}', "kda_rollback"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "block"}', "rejection_sample_method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "prompt_lookup_max"),
    ("{not json", "JSON"),
])
def test_bad_configs_name_the_key(value, key):
    with pytest.raises(SpeculativeConfigError, match=key):
        SpeculativeConfig.parse(value)


def test_greedy_accepts_while_drafts_are_argmax():
    logits = torch.tensor([[0.0, 5, 1], [4, 0, 1], [0, 0, 9], [1, 2, 0]])
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [1, 0, 2], None, greedy, seed=0, step=0) == (3, 1)     # all accepted, bonus 1
    assert verify(logits, [1, 2, 2], None, greedy, seed=0, step=0) == (1, 0)     # second rejected -> argmax 0
    assert verify(logits, [0, 0, 2], None, greedy, seed=0, step=0) == (0, 1)


def test_sampled_distribution_is_preserved():
    """5,000 verify calls of one draft token from q: the emitted first token is distributed as
    p (the target after temperature), every frequency within 4.5 sigma."""
    p_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.05, 0.5, 0.3, 0.1, 0.05]], dtype=torch.float64)
    params = SamplingParams(temperature=0.8)
    p = target_probs(p_logits[:1], params)[0]
    n, counts = 5_000, torch.zeros(5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for trial in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        n_acc, token = verify(p_logits, [draft], q, params, seed=trial, step=trial % 7)
        counts[draft if n_acc == 1 else token] += 1
    freq = counts / n
    for i in range(5):
        sigma = math.sqrt(p[i] * (1 - p[i]) / n)
        assert abs(freq[i] - p[i]) < 4.5 * sigma, (i, freq[i].item(), p[i].item())


def test_identical_draft_is_always_accepted():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    q = target_probs(logits[:3], params).float()
    accepted = 0
    for seed in range(200):
        drafts = [int(torch.multinomial(q[i], 1, generator=torch.Generator().manual_seed(seed * 3 + i))) for i in range(3)]
        accepted += verify(logits, drafts, q, params, seed=seed, step=0)[0]
    assert accepted == 600


def test_biased_requests_are_not_drafted_for():
    """Acceptance compares the draft with the raw target distribution: a logit_bias request
    would be verified against the wrong one, so it decodes without drafts."""
    from types import SimpleNamespace

    from k3.engine.spec.driver import SpeculativeStep

    def request(**params):
        return SimpleNamespace(num_computed_tokens=4, num_tokens=5, grammar=None, output_token_ids=[1],
                               params=SamplingParams(temperature=0, **params))

    assert SpeculativeStep.eligible(request())
    assert not SpeculativeStep.eligible(request(logit_bias={3: 2.0}))


def test_sampled_drafts_cut_by_a_grammar_keep_the_distribution():
    """A sampled draft the grammar refuses stays as the last draft (`cut_at_grammar`): the
    masked target rejects it for certain and the residual max(0, p - q) is drawn, so the first
    token is still distributed as the masked p. (Dropping it and drawing from p would give
    0.72 / 0.28 here instead of 0.8 / 0.2, over 10 sigma off at 4,000 trials.)"""
    from types import SimpleNamespace

    from k3.engine.spec.driver import cut_at_grammar

    grammar = SimpleNamespace(checkpoint=lambda: None, restore=lambda saved: None,
                              accept_draft=lambda token: token in (0, 1))          # tokens 2, 3 refused
    p = torch.tensor([0.8, 0.2, 0.0, 0.0], dtype=torch.float64)
    masked = torch.log(p).float()[None].expand(2, 4)                               # -inf where refused
    q = torch.tensor([[0.1, 0.5, 0.4, 0.0]], dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    n, counts = 4_000, torch.zeros(4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for trial in range(n):
        drafts, probs = cut_at_grammar(grammar, [int(torch.multinomial(q[0], 1, generator=gen))], q)
        assert len(drafts) == 1
        n_acc, token = verify(masked[: len(drafts) + 1], drafts, probs, params, seed=trial, step=trial % 5)
        counts[drafts[0] if n_acc == 1 else token] += 1
    freq = counts / n
    for i in range(4):
        sigma = math.sqrt(p[i] * (1 - p[i]) / n) + 1e-12
        assert abs(freq[i] - p[i]) < 4.5 * sigma, (i, freq[i].item(), p[i].item())
    assert cut_at_grammar(grammar, [1, 2, 0], None) == ([1], None)              # one-hot drafts end before it
