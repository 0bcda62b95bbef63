"""The reference platform's host-sync-free decode variants (k3.platforms.torch_kernels) equal the
naive oracle and the general paths: dense expert dispatch, padded indexer decode scores, paged
indexer decode scores read through a shuffled block table."""

import pytest
import torch

from k3 import reference as ref
from k3.platforms.torch_kernels import indexer_paged_decode, moe_experts
from k3.quant.mxfp4 import MXFP4Tensor


@pytest.mark.parametrize("mxfp4", [False, True])
def test_dense_dispatch_equals_sparse_and_the_oracle(mxfp4):
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
    sparse = moe_experts.experts_forward(x, w13, w2, weights, ids, **kw)
    dense = moe_experts.experts_forward(x, w13, w2, weights, ids, dense_dispatch=True, **kw)
    torch.testing.assert_close(dense, sparse, rtol=0, atol=1e-12)
    torch.testing.assert_close(sparse, ref.experts_forward(x, w13, w2, weights, ids, **kw), rtol=0, atol=1e-12)


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
    want = ref.indexer_scores(q, w, packed, cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), cu_seqlens_kv=cu)
    out = ref.indexer_decode_scores(q, w, keys, seq_lens)
    for j, length in enumerate(lens):
        torch.testing.assert_close(out[j, :length], want[j, :length], rtol=0, atol=1e-12)
        assert torch.isinf(out[j, length:]).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_paged_decode_scores_equal_the_oracle(fmt):
    """The batched paged read (every page gathered, masked) equals the oracle's position-by-position
    read; pages past a sequence are NaN-poisoned and must not leak."""
    g = torch.Generator().manual_seed(2)
    lens, page, hi, d = [5, 1, 12], 4, 4, 32
    n, pages = len(lens), 4
    q = torch.randn(n, hi, d, generator=g)
    w = torch.randn(n, hi, generator=g) * (hi * d) ** -0.5
    table = torch.randperm(n * pages, generator=g).view(n, pages).int()             # shuffled pages
    keys = ref.indexer_quantize_keys(torch.randn(n * pages * page, d, generator=g), fmt=fmt)
    values = keys.values.view(n * pages, page, *keys.values.shape[1:]).clone()
    scales = keys.scales.view(n * pages, page, *keys.scales.shape[1:]).clone()
    for j, length in enumerate(lens):                      # poison every slot past the sequence
        for pos in range(length, pages * page):
            p, s = int(table[j, pos // page]), pos % page
            values[p, s] = 255 if fmt == "mxfp4" else float("nan")
            scales[p, s] = 255 if fmt == "mxfp4" else float("nan")
    args = (q, w, values, scales, table, torch.tensor(lens))
    got = indexer_paged_decode.indexer_paged_decode_scores(*args, fmt=fmt)
    want = ref.indexer_paged_decode_scores(*args, fmt=fmt)
    assert got.shape == want.shape == (n, pages * page)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isfinite(want[~torch.isinf(want)]).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
