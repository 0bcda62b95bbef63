"""The amd plugin's served kernels with the AMD launch configurations (k3.platforms.amd.archs)
against the reference ops, on the simulated AMD platform (K3_AMD_SIMULATE) under the Triton
interpreter at tiny shapes: one conformance sample per entry whose AMD options differ from the
NVIDIA defaults (tile sizes, IEEE dots where a target has no tf32 / 3xTF32, the MoE mode).
This checks the configurations' numerics and the plugin's wiring only, not AMD code
generation (tests/kernels/test_amd_compile.py compiles them) and not AMD hardware."""

import pytest

from k3.conformance.registry import items
from k3.conformance.runner import RunContext, run_item
from k3.platform import select_platform

pytest.importorskip("k3.platforms.triton_kernels.moe_mxfp4")
from kernel_tables import interpretable  # noqa: E402

# entry -> kernel name of k3.platforms.amd.kernels (whose launch options the sample exercises)
ENTRIES = {"kda.decode_step": "kda_decode_step", "mla.decode": "mla_decode", "indexer.scores": "indexer_prefill_scores",
           "indexer.paged_decode_scores": "indexer_decode_scores", "moe.experts": "moe_experts"}


def _first_samples():
    seen, out = set(), []
    for item in items("full", ("kda", "mla", "indexer", "moe")):
        if item.case.entry in ENTRIES and item.dtype == "float32" and item.case.entry not in seen \
                and item.case.family != "cache" and interpretable(item) and not item.case.requires:
            seen.add(item.case.entry)
            out.append(item)
    return out


CASES = _first_samples()


def _runs():
    """(item, arch): gfx950 for every sample, gfx942 too where its options differ."""
    from k3.platforms.amd.archs import ARCHS

    for item in CASES:
        name = ENTRIES[item.case.entry]
        yield pytest.param(item, "gfx950", id=f"{item.id}-gfx950")
        if ARCHS["gfx942"].launch[name] != ARCHS["gfx950"].launch[name]:
            yield pytest.param(item, "gfx942", id=f"{item.id}-gfx942")


def test_every_reconfigured_entry_has_a_sample():
    assert {i.case.entry for i in CASES} == set(ENTRIES)


@pytest.mark.parametrize("item, arch", list(_runs()))
def test_sample_with_the_amd_launch_configuration(monkeypatch, arch, item):
    monkeypatch.setenv("K3_AMD_SIMULATE", arch)
    platform = select_platform("amd")
    assert platform.capabilities.arch == arch and platform.info.device == "cpu"
    family, entry = item.case.entry.split(".")
    served = getattr(getattr(platform.kernels, family), entry)
    assert platform.kernels.providers[item.case.entry] == "amd"
    from k3.platforms.amd import archs

    assert served.keywords == archs.ARCHS[arch].launch[ENTRIES[item.case.entry]]   # the table's options are bound
    outcome = run_item(RunContext(platform), item)
    assert outcome.passed, outcome.summary()
