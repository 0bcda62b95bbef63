"""DSA indexer prefill scores in Triton (platforms/triton_kernels/indexer_prefill.py): every
`indexer.scores` conformance sample (ragged sequences, a sequence with no queries, chunks after
a cached prefix, fp8-rounded and unrounded queries, 32 heads of 128; few-head samples take the
reference) with the kernel in place of the reference op, under the interpreter; bf16 inputs."""

import pytest
import torch

from k3 import reference as ref
from kernel_tables import run_with, samples

kernel = pytest.importorskip("k3.platforms.triton_kernels.indexer_prefill")

CASES = samples("indexer.scores")


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples_with_the_kernel(item):
    outcome = run_with(item, "indexer", scores=kernel.indexer_scores)
    assert outcome.passed, outcome.summary()


def test_bf16_keys_and_a_chunk_after_a_prefix():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 16, 32, generator=g).bfloat16()
    w = torch.randn(9, 16, generator=g) * 0.05
    keys = torch.randn(70, 32, generator=g).bfloat16()
    kw = dict(cu_seqlens_q=torch.tensor([0, 6, 9]), cu_seqlens_kv=torch.tensor([0, 50, 70]))
    assert kernel.covers(q, w, keys)
    got, want = kernel.indexer_scores(q, w, keys, **kw), ref.indexer_scores(q, w, keys, **kw)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert ((got[finite] - want[finite]).norm() / want[finite].norm()) < 1e-5
