"""The batch-invariant constructions (`k3.ops_helpers.invariant`): each gives a row the same bits
whatever rows share its call and wherever it sits, and computes what it names."""

from __future__ import annotations

import pytest
import torch

from k3 import reference as ref
from k3.ops_helpers import invariant as inv


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_ordered_sum_is_a_sum_over_any_dim_and_length():
    x = torch.randn(3, 37, 5, generator=_g(), dtype=torch.float64)
    for dim in (0, 1, -1):
        torch.testing.assert_close(inv.ordered_sum(x, dim), x.sum(dim), rtol=1e-12, atol=1e-12)
    assert inv.ordered_sum(x, 1, keepdim=True).shape == (3, 1, 5)
    assert inv.ordered_sum(torch.ones(2, 0), -1).tolist() == [0.0, 0.0]
    ints = torch.arange(100.0)
    assert inv.ordered_sum(ints, 0).item() == 4950.0


def test_ordered_sum_of_a_row_does_not_depend_on_the_rows_beside_it():
    row = torch.randn(1, 257, generator=_g(1))
    alone = inv.ordered_sum(row, -1)
    for t in (2, 31, 300):
        batch = torch.randn(t, 257, generator=_g(t))
        at = t // 2
        batch[at] = row[0]
        assert torch.equal(inv.ordered_sum(batch, -1)[at], alone[0])


@pytest.mark.parametrize("name", ["exp", "sigmoid", "silu", "softplus", "tanh", "log"])
def test_pointwise_functions_give_every_position_the_same_bits(name):
    """Each element equals the function of that element alone (a one-element call), at every
    position of tensors of several sizes, one of them large enough to be split over threads."""
    fn = getattr(inv, name)
    for n in (5, 1000, 70_001):
        x = torch.randn(n, generator=_g(n)) * 4
        if name == "log":
            x = x.abs() + 1e-3
        got = fn(x)
        # every element of the small ones; of the large one the vector tail, both threads'
        # chunk boundaries and random others (where torch's own CPU loops switch paths)
        picks = torch.arange(n) if n <= 1000 else torch.cat([torch.arange(n // 2 - 100, n // 2 + 100),
                                                              torch.arange(n - 100, n),
                                                              torch.randint(0, n, (300,), generator=_g(n))])
        alone = torch.stack([fn(x[i: i + 1])[0] for i in picks.tolist()])
        assert torch.equal(got[picks], alone), name
    torch.testing.assert_close(inv.sigmoid(x), torch.sigmoid(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_in_any_batch(dtype):
    """A row's product is the same alone, among random companions, anywhere in calls of 1 to 3
    row blocks; and it is x @ w^T."""
    w = torch.randn(96, 64, generator=_g(2)).to(dtype)
    row = torch.randn(1, 64, generator=_g(3)).to(dtype)
    alone = inv.linear(row, w)
    for t in (2, inv.ROW_BLOCK - 1, inv.ROW_BLOCK, 3 * inv.ROW_BLOCK - 5):
        batch = torch.randn(t, 64, generator=_g(t)).to(dtype)
        for at in (0, t // 2, t - 1):
            mixed = batch.clone()
            mixed[at] = row[0]
            assert torch.equal(inv.linear(mixed, w)[at], alone[0]), (t, at)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(alone, ref.linear(row, w), **tol)
    assert inv.linear(row[:0], w).shape == (0, 96)


def test_logsumexp_and_softmax_are_row_by_row():
    x = torch.randn(9, 512, generator=_g(4)) * 3
    x[2, 5:] = float("-inf")
    torch.testing.assert_close(inv.logsumexp(x), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(inv.softmax(x, -1), torch.softmax(x, -1), rtol=1e-5, atol=1e-7)
    for at in range(9):
        assert torch.equal(inv.logsumexp(x[at: at + 1])[0], inv.logsumexp(x)[at])
    assert inv.logsumexp(torch.full((1, 4), float("-inf"))).item() == float("-inf")
    assert torch.equal(inv.rsqrt(torch.tensor([4.0])), torch.tensor([0.5]))
