"""The indexer top-k on torch.topk (platforms/torch_kernels/indexer_topk.py): every
`indexer.topk` conformance sample (many exact ties, causal and ragged -inf masks, k past the
row, K3.1 Pro's 2,048 of 2,500) with it in place of the reference op, and the reference's errors
for malformed input."""

import dataclasses

import pytest
import torch

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platforms.torch_kernels.indexer_topk import indexer_topk
from k3.plugin import select_platform

CASES = [i for i in items("full", ("indexer",)) if i.case.name == "indexer.topk"]


def _with_kernel():
    platform = select_platform("reference")
    k = platform.kernels
    platform.kernels = dataclasses.replace(k, indexer=dataclasses.replace(k.indexer, topk=indexer_topk))
    return platform


def test_every_sample_is_collected():
    assert len(CASES) == 8


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples(item):
    outcome = run_item(RunContext(_with_kernel()), item)
    assert outcome.passed, outcome.summary()


def test_malformed_input_gets_the_reference_error():
    with pytest.raises(ValueError, match="topk must be a positive int"):
        indexer_topk(torch.zeros(2, 3), topk=0)
    with pytest.raises(ValueError, match=r"scores must be a float tensor \[T, L\]"):
        indexer_topk(torch.zeros(3), topk=1)
