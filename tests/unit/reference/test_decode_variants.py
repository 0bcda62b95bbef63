"""Host-sync-free decode variants equal the general ops."""

import pytest
import torch

from k3.quant.mxfp4 import MXFP4Tensor
from k3.reference import experts_forward, indexer_decode_scores, indexer_scores


@pytest.mark.parametrize("mxfp4", [False, True])
def test_dense_dispatch_equals_sparse(mxfp4):
    g = torch.Generator().manual_seed(0)
    t, l, i, e, k = 9, 32, 32, 6, 2
    x = torch.randn(t, l, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * i, l, generator=g, dtype=torch.float64) / l ** 0.5
    w2 = torch.randn(e, l, i, generator=g, dtype=torch.float64) / i ** 0.5
    if mxfp4:
        w13, w2 = MXFP4Tensor.from_float(w13), MXFP4Tensor.from_float(w2)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])       # some ids on another rank
    weights = torch.rand(t, k, generator=g, dtype=torch.float64)
    kw = dict(activation="situ", beta=4.0, linear_beta=25.0, expert_start=1)
    sparse = experts_forward(x, w13, w2, weights, ids, **kw)
    dense = experts_forward(x, w13, w2, weights, ids, dense_dispatch=True, **kw)
    torch.testing.assert_close(dense, sparse, rtol=0, atol=1e-12)


def test_decode_scores_equal_varlen_scores():
    g = torch.Generator().manual_seed(1)
    lens = [5, 1, 12]
    n, hi, d, pad = len(lens), 4, 32, 16
    q = torch.randn(n, hi, d, generator=g, dtype=torch.float64)
    w = torch.randn(n, hi, generator=g, dtype=torch.float64)
    keys = torch.randn(n, pad, d, generator=g, dtype=torch.float64)
    keys[0, lens[0]:] = float("nan")                       # padding must not leak
    seq_lens = torch.tensor(lens)
    packed = torch.cat([keys[j, :lens[j]] for j in range(n)])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = indexer_scores(q, w, packed, cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), cu_seqlens_kv=cu)
    out = indexer_decode_scores(q, w, keys, seq_lens)
    for j, length in enumerate(lens):
        torch.testing.assert_close(out[j, :length], ref[j, :length], rtol=0, atol=1e-12)
        assert torch.isinf(out[j, length:]).all()
