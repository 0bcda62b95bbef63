"""Sampling reference: filters keep exactly the right tokens; draws follow the distribution."""

import math

import pytest
import torch

from k3.reference.sampling import filtered_logits, sample, sampling_probs

P = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
LOGITS = P.log()


def _kept(**kw):
    return torch.isfinite(filtered_logits(LOGITS, **kw))[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("kw,kept", [
    ({}, [0, 1, 2, 3]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_k": 1}, [0]),
    ({"top_k": 0}, [0, 1, 2, 3]),
    ({"top_p": 0.7}, [0, 1]),
    ({"top_p": 0.5}, [0]),
    ({"top_p": 0.81}, [0, 1, 2]),
    ({"top_p": 1.0}, [0, 1, 2, 3]),
    ({"min_p": 0.5}, [0, 1]),
    ({"min_p": 0.2}, [0, 1, 2]),
    ({"top_k": 3, "top_p": 0.9}, [0, 1, 2]),
    ({"min_p": 0.5, "top_p": 0.6}, [0]),   # min-p first; top-p sees the renormalised 0.625 / 0.375
])
def test_filters_keep_exactly(kw, kept):
    assert _kept(**kw) == kept


def test_temperature_scales_logits():
    torch.testing.assert_close(sampling_probs(LOGITS, temperature=0.5)[0], P[0] ** 2 / (P[0] ** 2).sum())


def test_per_row_parameters():
    logits = LOGITS.repeat(3, 1)
    out = torch.isfinite(filtered_logits(logits, top_k=torch.tensor([1, 2, 0]), top_p=torch.tensor([1.0, 1.0, 0.7])))
    assert out.sum(1).tolist() == [1, 2, 2]


def test_greedy_rows_take_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.3])
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    out = sample(logits, temperature=temps, generators=gens)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert out[temps == 0].tolist() == logits.argmax(-1)[temps == 0].tolist()
    assert sample(logits, temperature=1.0, top_k=1).tolist() == logits.argmax(-1).tolist()


def test_seeded_row_independent_of_batch_company():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 64, generator=g)
    alone = [sample(logits[i:i + 1], temperature=0.9, top_p=0.95,
                    generators=[torch.Generator().manual_seed(100 + i)]).item() for i in range(5)]
    batch = sample(logits, temperature=0.9, top_p=0.95,
                   generators=[torch.Generator().manual_seed(100 + i) for i in range(5)])
    assert batch.tolist() == alone


def test_draws_follow_the_filtered_distribution():
    # 20,000 seeded draws from top-k 3 at temperature 0.8; every frequency within 4.5 sigma.
    n = 20_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0]])
    gen = torch.Generator().manual_seed(1234)
    draws = sample(logits.expand(n, -1), temperature=0.8, top_k=3, generators=[gen] * n)
    freq = torch.bincount(draws, minlength=5).double() / n
    p = sampling_probs(logits.double(), temperature=0.8, top_k=3)[0]
    assert freq[3] == 0 and freq[4] == 0
    for i in range(3):
        sigma = math.sqrt(p[i] * (1 - p[i]) / n)
        assert abs(freq[i] - p[i]) < 4.5 * sigma, (i, freq[i].item(), p[i].item())
