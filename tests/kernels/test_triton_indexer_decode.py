"""DSA indexer decode scores over the fp8 key pages in Triton
(platforms/triton_kernels/indexer_decode.py): every `indexer.paged_decode_scores` conformance
sample with the kernel in place of the reference op (shuffled pages, NaN-poisoned slots past each
sequence, 32 heads of 128, unquantised queries, the MXFP4 and few-head fallbacks), under the
interpreter; and a block of positions that straddles the end of the table."""

import pytest
import torch

from k3 import reference as ref
from kernel_tables import run_with, samples

kernel = pytest.importorskip("k3.platforms.triton_kernels.indexer_decode")

CASES = samples("indexer.paged_decode_scores")


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_conformance_samples_with_the_kernel(item):
    outcome = run_with(item, "indexer", paged_decode_scores=kernel.paged_decode_scores)
    assert outcome.passed, outcome.summary()


def test_the_kernel_covers_the_k3_shapes_and_writes_only_its_rows():
    g = torch.Generator().manual_seed(3)
    n, hi, d, page, pages = 2, 16, 32, 8, 3                # 24 positions: a 64-position block straddles the end
    keys = torch.randn(n * pages, page, d, generator=g)
    quantized = ref.indexer_quantize_keys(keys.reshape(-1, d), fmt="fp8")
    values, scales = quantized.values, quantized.scales
    values, scales = values.view(n * pages, page, d), scales.view(n * pages, page)
    table = torch.randperm(n * pages, generator=g).view(n, pages).int()
    q, w, lens = torch.randn(n, hi, d, generator=g), torch.randn(n, hi, generator=g), torch.tensor([24, 9])
    assert kernel.covers(q, w, values, scales, "fp8")
    got = kernel.paged_decode_scores(q, w, values, scales, table, lens, fmt="fp8")
    want = ref.indexer_paged_decode_scores(q, w, values, scales, table, lens, fmt="fp8")
    assert got.shape == (n, pages * page) and torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_mxfp4_kernel_matches_the_reference_over_poisoned_pages():
    """MXFP4 pages (platforms/triton_kernels/indexer_decode_mxfp4.py, what `paged_decode_scores`
    runs for fmt "mxfp4"): shuffled pages, 0xFF-poisoned slots past each sequence (NaN scales
    there must not leak), a block that straddles the end of the table."""
    mx = pytest.importorskip("k3.platforms.triton_kernels.indexer_decode_mxfp4")
    g = torch.Generator().manual_seed(4)
    n, hi, d, page, pages = 2, 16, 64, 8, 3
    values = torch.full((n * pages, page, d // 2), 255, dtype=torch.uint8)
    scales = torch.full((n * pages, page, d // 32), 255, dtype=torch.uint8)
    table = torch.randperm(n * pages, generator=g).view(n, pages).int()
    lens = torch.tensor([24, 9])
    for i, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots = (table[i, pos // page].long(), pos % page)
        keys = torch.randn(length, d, generator=g) * torch.logspace(-2, 1, length)[:, None]   # wide scale range
        quantized = ref.indexer_quantize_keys(keys, fmt="mxfp4")
        values[slots], scales[slots] = quantized.values, quantized.scales
    q, w = torch.randn(n, hi, d, generator=g), torch.randn(n, hi, generator=g)
    assert mx.covers(q, w, values, scales, "mxfp4")
    got = kernel.paged_decode_scores(q, w, values, scales, table, lens, fmt="mxfp4")
    want = ref.indexer_paged_decode_scores(q, w, values, scales, table, lens, fmt="mxfp4")
    assert got.shape == (n, pages * page) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isfinite(got[~torch.isinf(got)]).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
