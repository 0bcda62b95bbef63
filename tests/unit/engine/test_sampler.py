"""The engine sampler: counter-based noise, penalties, masks, exact distributions."""

import math

import torch

from k3.engine.sampler import SamplingBatch, apply_penalties, sample_batch, uniform_noise
from k3.reference.sampling import sampling_probs


def _batch(b, **kw):
    base = dict(temperature=torch.ones(b), top_k=torch.zeros(b, dtype=torch.long), top_p=torch.ones(b),
                min_p=torch.zeros(b), seeds=torch.arange(b), steps=torch.zeros(b, dtype=torch.long))
    base.update(kw)
    return SamplingBatch(**base)


def test_noise_is_a_function_of_seed_step_token():
    a = uniform_noise(torch.tensor([5, 9, 5]), torch.tensor([0, 0, 3]), 1000)
    b = uniform_noise(torch.tensor([9, 5]), torch.tensor([0, 0]), 1000)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and (a < 1).all() and a.dtype == torch.float64
    big = uniform_noise(torch.arange(200), torch.zeros(200, dtype=torch.long), 5000).flatten()
    assert abs(big.mean().item() - 0.5) < 0.002 and abs(big.var().item() - 1 / 12) < 0.001


def test_negative_and_huge_seeds():
    u = uniform_noise(torch.tensor([-1, 2 ** 62, -(2 ** 63)]), torch.tensor([1, 1, 1]), 64)
    assert torch.isfinite(u).all() and (u > 0).all() and (u < 1).all()


def test_greedy_and_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    out = sample_batch(logits, _batch(4, temperature=torch.zeros(4)))
    assert torch.equal(out.tokens, logits.argmax(-1))
    allowed = torch.zeros(4, 50, dtype=torch.bool)
    allowed[:, 7] = True
    allowed[2, 9] = True
    out = sample_batch(logits, _batch(4, allowed=allowed))
    assert out.tokens.tolist()[:2] == [7, 7] and out.tokens[2] in (7, 9) and out.tokens[3] == 7


def test_seeded_rows_ignore_batch_company():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 80, generator=g)
    kw = dict(temperature=torch.full((6,), 0.8), top_p=torch.full((6,), 0.9), seeds=torch.tensor([11, 12, 13, 14, 15, 16]),
              steps=torch.tensor([0, 1, 2, 3, 4, 5]))
    together = sample_batch(logits, _batch(6, **kw)).tokens
    for i in range(6):
        alone = sample_batch(logits[i:i + 1], _batch(1, **{k: v[i:i + 1] for k, v in kw.items()})).tokens
        assert alone.item() == together[i].item()


def test_draws_follow_the_filtered_distribution():
    n = 20_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0]]).expand(n, -1)
    b = _batch(n, temperature=torch.full((n,), 0.7), top_p=torch.full((n,), 0.9), seeds=torch.full((n,), 42),
               steps=torch.arange(n))
    freq = torch.bincount(sample_batch(logits, b).tokens, minlength=5).double() / n
    p = sampling_probs(logits[:1].double(), temperature=0.7, top_p=0.9)[0]
    for i in range(5):
        sigma = math.sqrt(max(p[i] * (1 - p[i]), 1e-12) / n)
        assert abs(freq[i] - p[i]) <= 4.5 * sigma + 1e-12, (i, freq[i].item(), p[i].item())


def test_logit_bias_shifts_the_drawn_distribution():
    n = 20_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0]]).expand(n, -1)
    bias = torch.tensor([[0.0, -100.0, 0.0, 2.5, 0.0]]).expand(n, -1)
    b = _batch(n, temperature=torch.full((n,), 0.8), seeds=torch.full((n,), 7), steps=torch.arange(n),
               logit_bias=bias, num_logprobs=1)
    out = sample_batch(logits, b)
    freq = torch.bincount(out.tokens, minlength=5).double() / n
    p = torch.softmax((logits[0] + bias[0]).double() / 0.8, -1)          # the biased distribution, by hand
    assert freq[1] == 0
    for i in range(5):
        sigma = math.sqrt(max(p[i] * (1 - p[i]), 1e-12) / n)
        assert abs(freq[i] - p[i]) <= 4.5 * sigma + 1e-12, (i, freq[i].item(), p[i].item())
    raw = torch.log_softmax(logits[:1], -1)[0]                             # logprobs stay the raw model's
    torch.testing.assert_close(out.logprobs, raw[out.tokens])
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0, 100.0], [-100.0, 0.0, 0.0, 0.0, 0.0]])
    greedy = sample_batch(logits[:2], _batch(2, temperature=torch.zeros(2), logit_bias=rows))
    assert greedy.tokens.tolist() == [4, 1]          # forced up; the argmax banned leaves the runner-up


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[0, 2, 1, 0]], dtype=torch.int32)
    prompt = torch.tensor([[True, False, False, False]])
    b = _batch(1, repetition_penalty=torch.tensor([2.0]), presence_penalty=torch.tensor([0.5]),
               frequency_penalty=torch.tensor([0.25]), token_counts=counts, prompt_mask=prompt)
    out = apply_penalties(logits, b)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.5 - 0.5, 0.5 / 2 - 0.25 - 0.5, 3.0]])
    torch.testing.assert_close(out, expected)


def test_logprobs_are_of_the_raw_distribution():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=g)
    out = sample_batch(logits, _batch(3, temperature=torch.full((3,), 0.5), num_logprobs=4))
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, raw.topk(4, -1).values)


def test_host_flags_take_shorter_paths_that_draw_the_same_tokens():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, 300, generator=g) * 3
    greedy = _batch(64, temperature=torch.zeros(64), num_logprobs=3)
    full, fast = sample_batch(logits, greedy), sample_batch(logits, _batch(64, temperature=torch.zeros(64),
                                                                            num_logprobs=3, all_greedy=True))
    assert torch.equal(full.tokens, fast.tokens) and torch.equal(fast.tokens, logits.argmax(-1))
    torch.testing.assert_close(full.logprobs, fast.logprobs)
    torch.testing.assert_close(full.top_logprobs, fast.top_logprobs)
    bare = sample_batch(logits, SamplingBatch(num_logprobs=3, all_greedy=True))   # no draw parameters at all
    assert torch.equal(bare.tokens, fast.tokens) and torch.equal(bare.logprobs, fast.logprobs)
    # rows mixing greedy and sampled, no filters: the race without the sort draws the same tokens
    kw = dict(temperature=torch.tensor([0.0, 0.7, 1.3, 0.0] * 16), seeds=torch.arange(64) * 7 + 1,
              steps=torch.arange(64) % 5)
    full, fast = sample_batch(logits, _batch(64, **kw)), sample_batch(logits, _batch(64, **kw, filters_off=True))
    assert torch.equal(full.tokens, fast.tokens)
    assert not torch.equal(fast.tokens, logits.argmax(-1))       # the sampled rows did sample
    torch.testing.assert_close(full.logprobs, fast.logprobs)


def test_logprobs_match_log_softmax_on_wide_rows():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 163_840, generator=g) * 4
    out = sample_batch(logits, _batch(2, temperature=torch.zeros(2), num_logprobs=2, all_greedy=True))
    raw = torch.log_softmax(logits.double(), -1).float()
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out.top_logprobs, raw.topk(2, -1).values, atol=2e-5, rtol=0)


def test_a_greedy_step_copies_no_draw_parameters():
    """build_sampling leaves the draw parameters out of an all-greedy batch (the argmax reads
    none of them) and builds them when any row samples."""
    from types import SimpleNamespace

    from k3.engine.params import SamplingParams
    from k3.engine.runner import build_sampling

    def step(*temperatures):
        reqs = [SimpleNamespace(params=SamplingParams(temperature=t), seed=i, output_token_ids=[1, 2],
                                prompt_token_ids=[3]) for i, t in enumerate(temperatures)]
        out = SimpleNamespace(scheduled=[SimpleNamespace(request=r, output_index=len(r.output_token_ids)) for r in reqs])
        return build_sampling(out, list(range(len(reqs))), vocab_size=10, device="cpu")

    greedy = step(0.0, 0.0)
    assert greedy.all_greedy and greedy.temperature is None and greedy.seeds is None and greedy.steps is None
    mixed = step(0.0, 0.8)
    assert not mixed.all_greedy and mixed.temperature.tolist() == [0.0, 0.800000011920929]
    assert mixed.steps.tolist() == [2, 2] and mixed.seeds.tolist() == [0, 1]
