"""DSA indexer prefill scores with the heads batched (platforms/torch_kernels/
indexer_scores_blocked.py) against k3.reference.indexer_scores: ragged sequences, a span with no
query, chunked prefill after a prefix, query blocks of a few rows (the block bound made tiny),
fp8-rounded and plain queries; the output starts poisoned in neither (a fresh tensor)."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import indexer_scores_blocked as blocked


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("block", [blocked.BLOCK_ELEMENTS, 64])
def test_matches_the_reference(monkeypatch, quantize, block):
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", block)            # 64: one or two query rows a block
    g = torch.Generator().manual_seed(int(quantize) + block % 7)
    q_lens, kv_lens = [5, 0, 3, 9], [5, 4, 11, 9]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(q_lens), 4, 32, generator=g)
    w, keys = torch.randn(sum(q_lens), 4, generator=g), torch.randn(sum(kv_lens), 32, generator=g)
    kw = dict(cu_seqlens_q=cu(q_lens), cu_seqlens_kv=cu(kv_lens), quantize_query=quantize)
    got, want = blocked.indexer_scores(q, w, keys, **kw), ref.indexer_scores(q, w, keys, **kw)
    assert got.shape == want.shape and torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bad_shapes_raise_the_contract_error():
    with pytest.raises(ValueError, match="indexer_scores"):
        blocked.indexer_scores(torch.zeros(2, 4, 8), torch.zeros(2, 3), torch.zeros(5, 8),
                               cu_seqlens_q=torch.tensor([0, 2]), cu_seqlens_kv=torch.tensor([0, 5]))
