"""Kernels over cache views as the model drives them: fp8 latent pages, index-key pages, KDA
state rows (family cache)."""

from k3.conformance.runner import run_item

K3_FAMILIES = ("cache",)


def test_cache_view(k3_item, k3_ctx, k3_record):
    outcome = run_item(k3_ctx, k3_item)
    k3_record(outcome)
    assert outcome.passed, outcome.summary()
