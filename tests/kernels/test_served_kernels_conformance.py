"""Every conformance sample of the kernel entries the nvidia platform serves, with k3's kernels
in place of the reference ops (the table `test_model_with_kernels.with_kernels` builds), under
the Triton interpreter: the CPU half of `k3 conformance --platform nvidia`, so a kernel change
that breaks a sample fails here before any device time is spent. Races between threads, which
the interpreter cannot show, are the GPU run's to find."""

import pytest

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform

pytest.importorskip("k3.platforms.triton_kernels.moe_mxfp4")
from kernel_tables import interpretable  # noqa: E402
from test_model_with_kernels import with_kernels  # noqa: E402

SERVED = {"kda.short_conv", "kda.decode_step", "moe.experts", "moe.select_experts", "attn_res.step", "mla.decode",
          "mla.prefill", "elementwise.rms_norm", "elementwise.glu_activation"}
CASES = [i for i in items("full", ("kda", "moe", "attn_res", "mla", "cache", "elementwise"))
         if i.dtype != "float64" and (i.case.entry in SERVED or i.case.family == "cache") and interpretable(i)]


def test_every_served_entry_has_samples():
    assert {i.case.entry for i in CASES} >= SERVED


@pytest.mark.parametrize("item", CASES, ids=lambda i: i.id)
def test_sample_with_the_served_kernels(item):
    outcome = run_item(RunContext(with_kernels(select_platform("reference"))), item)
    assert outcome.passed, outcome.summary()

