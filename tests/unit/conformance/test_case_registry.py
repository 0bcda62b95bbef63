"""Meta-tests of the case registry: every kernel entry and every hook is covered, ids are
well formed, requirements are real capability names."""

import inspect

import pytest

from k3.conformance import coverage
from k3.conformance.registry import FAMILIES, KERNEL_FAMILIES, all_cases, items
from k3.plugin import KERNEL_TABLES, Capabilities, hookspecs


def test_every_kernel_entry_has_a_case():
    entries = {case.entry for case in all_cases()}
    missing = [f"{t.FAMILY}.{e}" for t in KERNEL_TABLES for e in t.entries() if f"{t.FAMILY}.{e}" not in entries]
    assert not missing, f"kernel entries without a conformance case: {missing}"


def test_kernel_cases_use_the_tables_reference_op():
    """A case named after an entry uses the reference op the kernel table names as its oracle."""
    import k3.reference as ref
    from k3.plugin.tables import entry_oracle

    for table in KERNEL_TABLES:
        for entry in table.entries():
            name = f"{table.FAMILY}.{entry}"
            case = next((c for c in all_cases() if c.name == name), None)
            assert case is not None, name
            op = getattr(ref, entry_oracle(table, entry))
            assert case.reference is op, f"{name}: oracle {case.reference} is not {op}"


def test_every_hookspec_is_covered_or_tested_elsewhere():
    specs = {name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
             if name.startswith("k3_") and hasattr(fn, "k3_spec")}
    listed = set(coverage.HOOK_FAMILIES) | set(coverage.TESTED_ELSEWHERE)
    assert specs - listed == set(), f"hookspecs without conformance coverage: {sorted(specs - listed)}"
    assert listed - specs == set(), f"coverage lists hooks that no longer exist: {sorted(listed - specs)}"
    families = {c.family for c in all_cases()}
    for hook, family in coverage.HOOK_FAMILIES.items():
        assert family in families, f"{hook}: no case in family {family!r}"


def test_every_family_has_cases():
    assert {c.family for c in all_cases()} == set(FAMILIES)


def test_ids_are_unique_and_name_shapes():
    full = items("full")
    ids = [i.id for i in full]
    assert len(ids) == len(set(ids))
    for item in full:
        case, shape, dtype = item.id.split("/")
        assert case == item.case.name and shape == item.sample.shape and dtype == item.dtype
        assert any(ch.isdigit() for ch in shape), f"{item.id}: the shape id should name sizes"


def test_requirements_are_capability_names():
    caps = Capabilities(dist_backend="nccl", device_count=1)
    for item in items("full"):
        for requirement in item.requirements(caps):
            assert requirement in Capabilities.REQUIREMENTS, (item.id, requirement)


def test_collectives_need_two_devices_only_off_gloo():
    item = next(i for i in items("smoke") if i.case.family == "collectives")
    assert "multi_device" not in item.requirements(Capabilities(dist_backend="gloo"))
    assert "multi_device" in item.requirements(Capabilities(dist_backend="nccl"))


def test_smoke_tier_is_one_item_per_case():
    smoke = items("smoke")
    assert len(smoke) == len(all_cases())
    assert all(i.sample is i.case.samples[0] and i.dtype == i.case.smoke() for i in smoke)
    with pytest.raises(ValueError, match="unknown tier"):
        items("medium")


def test_kernel_families_have_a_sample_maker():
    for case in all_cases():
        if case.family in KERNEL_FAMILIES and case.run is None:
            assert case.reference is not None and all(s.make for s in case.samples), case.name


def test_named_kernel_outputs_are_compared_by_field_without_an_outputs_function():
    """A case without `outputs` compares a kernel's named outputs field by field: tuple fields
    entry by entry, fields the call did not ask for (None) left out."""
    import torch

    from k3.conformance.inputs import Inputs
    from k3.conformance.registry import Case, Sample
    from k3.conformance.runner import named_outputs
    from k3.plugin.kernels import KDAChunkedOut, KDARecurrentOut

    case = Case("x", "kda", "kda.chunked", samples=(Sample("T1"),))
    o, s, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert named_outputs(case, KDAChunkedOut(o, s, (c, c)), Inputs((), {})).keys() == {"o", "state", "checkpoints0",
                                                                                        "checkpoints1"}
    assert named_outputs(case, KDARecurrentOut(o, s), Inputs((), {})).keys() == {"o", "state"}
