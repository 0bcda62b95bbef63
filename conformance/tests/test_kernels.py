"""Every kernel-table entry against its float64 oracle (families kda, mla, indexer, moe,
attn_res, elementwise, quant)."""

from k3.conformance.registry import KERNEL_FAMILIES
from k3.conformance.runner import run_item

K3_FAMILIES = KERNEL_FAMILIES


def test_kernel(k3_item, k3_ctx, k3_record):
    outcome = run_item(k3_ctx, k3_item)
    k3_record(outcome)
    assert outcome.passed, outcome.summary()
