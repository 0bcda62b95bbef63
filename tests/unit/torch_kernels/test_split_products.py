"""The hi / lo split (platforms/torch_kernels/split_products.py): fp32 activations into bf16
products without rounding them, on fresh random inputs, groups of every size including empty
ones, and no host read (captured whole by torch.compile(fullgraph=True))."""

import pytest
import torch

from k3.platforms.torch_kernels.split_products import (batched_split_product, interleave_groups, merge_rows,
                                                       split_bf16)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_the_split_is_exact_to_two_to_the_minus_sixteen():
    a = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 10
    hi, lo = split_bf16(a)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert ((hi.float() + lo.float() - a).abs() <= a.abs() * 2.0 ** -16).all()
    assert _rel(hi.float(), a) > 2.0 ** -12                 # hi alone rounds: the check above can fail


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7], [1], [4, 4, 0, 0]])
def test_interleaved_groups_come_back_per_row(counts):
    g = torch.Generator().manual_seed(sum(counts))
    c = torch.tensor(counts)
    a = torch.randn(int(c.sum()), 32, generator=g)
    w = torch.randn(len(counts), 16, 32, generator=g).bfloat16()               # a weight per group
    rows, hi_pos, lo_pos = interleave_groups(a, c)
    assert rows.shape == (2 * a.shape[0], 32) and rows.dtype == torch.bfloat16
    start = 0
    for e, n in enumerate(counts):                                              # group e: hi rows, then lo rows
        hi, lo = split_bf16(a[start:start + n])
        assert torch.equal(rows[2 * start:2 * start + n], hi) and torch.equal(rows[2 * start + n:2 * (start + n)], lo)
        start += n
    group = torch.repeat_interleave(torch.arange(len(counts)), c)                # [M] each row's group
    row_group = torch.empty(rows.shape[0], dtype=torch.long)
    row_group[hi_pos], row_group[lo_pos] = group, group                         # [2M] each split row's group
    products = torch.einsum("rk,rnk->rn", rows.float(), w[row_group].float()).bfloat16()   # bf16 outputs
    got = merge_rows(products, hi_pos, lo_pos, torch.float32)
    want = torch.einsum("rk,rnk->rn", a.double(), w[group].double())
    assert _rel(got, want) < 2.0 ** -9 and _rel(got, want) < _rel(torch.einsum(
        "rk,rnk->rn", a.bfloat16().float(), w[group].float()).bfloat16(), want)


def test_the_batched_split_beats_rounding_the_operand_and_reads_no_host():
    g = torch.Generator().manual_seed(3)
    a, w_t = torch.randn(4, 5, 64, generator=g), torch.randn(4, 64, 48, generator=g).bfloat16()
    want = torch.matmul(a.double(), w_t.double())
    got = batched_split_product(a, w_t)
    rounded = torch.matmul(a.bfloat16(), w_t).float()                           # the operand rounded too
    assert got.dtype == torch.float32 and _rel(got, want) < 0.75 * _rel(rounded, want)
    torch._dynamo.reset()
    counts = torch.tensor([2, 0, 3])
    compiled = torch.compile(lambda x, c: interleave_groups(x, c)[0], fullgraph=True, backend="eager")
    x = torch.randn(5, 8, generator=g)
    assert torch.equal(compiled(x, counts), interleave_groups(x, counts)[0])
