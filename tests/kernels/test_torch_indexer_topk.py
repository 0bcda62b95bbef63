"""The indexer top-k on torch.topk (platforms/torch_kernels/indexer_topk.py): every
`indexer.topk` conformance sample (many exact ties, causal and ragged -inf masks, k past the
row, K3.1 Pro's 2,048 of 2,500) with it in place of the reference op, and the reference's errors
for malformed input."""

import pytest
import torch

from k3.platforms.torch_kernels.indexer_topk import indexer_topk
from kernel_tables import run_with, samples

CASES = samples("indexer.topk", float64=True)

def test_every_sample_is_collected():
    assert len(CASES) == 8


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples(item):
    outcome = run_with(item, "indexer", topk=indexer_topk)
    assert outcome.passed, outcome.summary()


def test_malformed_input_gets_the_reference_error():
    with pytest.raises(ValueError, match="topk must be a positive int"):
        indexer_topk(torch.zeros(2, 3), topk=0)
    with pytest.raises(ValueError, match=r"scores must be a float tensor \[T, L\]"):
        indexer_topk(torch.zeros(3), topk=1)
