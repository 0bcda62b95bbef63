"""The tiny end-to-end models on the platform's kernels: greedy tokens against the reference
kernels with chunked prefill, and batch invariance (family model)."""

from k3.conformance.runner import run_item

K3_FAMILIES = ("model",)


def test_model(k3_item, k3_ctx, k3_record):
    outcome = run_item(k3_ctx, k3_item)
    k3_record(outcome, provider=k3_ctx.platform.info.plugin)
    assert outcome.passed, outcome.summary()
