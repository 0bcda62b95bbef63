"""The variants of each kernel entry agree at the rounding points (family variants, issue 32):
the same rows alone and in other batches, through other step kinds (k3.conformance.cases.variants)."""

from k3.conformance.runner import run_item

K3_FAMILIES = ("variants",)


def test_variants(k3_item, k3_ctx, k3_record):
    outcome = run_item(k3_ctx, k3_item)
    k3_record(outcome)
    assert outcome.passed, outcome.summary()
