"""Every implementation of a kernel entry has its protocol's signature (`k3.plugin.kernels`):
the naive oracle in k3.reference exactly; the pure-torch kernels the reference platform serves,
every kernel the nvidia plugin can serve (promoted and experimental) and the conformance
case's inputs with the same parameter names, kinds and defaults, a kernel adding only
keyword-only options with defaults."""

import inspect

import pytest
import torch

from k3 import reference as ref
from k3.conformance.registry import all_cases
from k3.platforms.nvidia import experimental
from k3.platforms.torch_kernels.tables import torch_tables
from k3.plugin import KERNEL_TABLES
from k3.plugin.tables import entry_oracle, entry_protocol

ENTRIES = [(t, e) for t in KERNEL_TABLES for e in t.entries()]
ENTRY_IDS = [f"{t.FAMILY}.{e}" for t, e in ENTRIES]
TABLES = {t.FAMILY: t for t in KERNEL_TABLES}


def contract(protocol) -> list[inspect.Parameter]:
    return list(inspect.signature(protocol.__call__).parameters.values())[1:]          # without self


def mismatches(impl, protocol, *, exact: bool) -> list[str]:
    """What keeps `impl` from having the protocol's signature (empty: it has it)."""
    want, got = contract(protocol), list(inspect.signature(impl).parameters.values())
    found = []
    for i, w in enumerate(want):
        g = got[i] if i < len(got) else None
        if g is None or (g.name, g.kind, g.default) != (w.name, w.kind, w.default):
            found.append(f"parameter {i}: want {w.name} ({w.kind.description}, default {w.default!r}), got "
                         + ("nothing" if g is None else f"{g.name} ({g.kind.description}, default {g.default!r})"))
    for g in got[len(want):]:
        if exact or g.kind is not inspect.Parameter.KEYWORD_ONLY or g.default is inspect.Parameter.empty:
            found.append(f"extra parameter {g.name} ({g.kind.description}): "
                         + ("the oracle adds none" if exact else "options must be keyword-only with a default"))
    return found


def test_the_check_catches_a_wrong_signature():
    from k3.plugin.kernels import RMSNorm

    def renamed(x, w, eps):
        return x

    def positional_option(x, weight, eps, block=64):
        return x

    def option(x, weight, eps, *, block=64):
        return x

    assert mismatches(renamed, RMSNorm, exact=False)
    assert mismatches(positional_option, RMSNorm, exact=False)
    assert not mismatches(option, RMSNorm, exact=False) and mismatches(option, RMSNorm, exact=True)


@pytest.mark.parametrize("table, entry", ENTRIES, ids=ENTRY_IDS)
def test_the_oracle_has_the_protocols_signature(table, entry):
    protocol = entry_protocol(table, entry)
    oracle = getattr(ref, entry_oracle(table, entry))
    assert not mismatches(oracle, protocol, exact=True), (oracle, mismatches(oracle, protocol, exact=True))
    want = inspect.signature(protocol.__call__).return_annotation
    got = str(inspect.signature(oracle).return_annotation).rsplit(".", 1)[-1]   # "torch.Tensor" is "Tensor"
    assert got == want, f"{oracle.__name__} is annotated to return {got}, the protocol {want}"


@pytest.mark.parametrize("table, entry", ENTRIES, ids=ENTRY_IDS)
def test_the_reference_platforms_kernel_has_the_protocols_signature(table, entry):
    kernel = getattr(torch_tables()[table.FAMILY], entry)
    assert kernel is not None, f"the reference platform serves no {table.FAMILY}.{entry}"
    problems = mismatches(kernel, entry_protocol(table, entry), exact=False)
    assert not problems, f"{kernel.__module__}.{kernel.__name__}: {problems}"


NVIDIA = experimental.ALL


@pytest.mark.parametrize("name", sorted(NVIDIA))
def test_every_nvidia_kernel_has_the_protocols_signature(name):
    kernel = NVIDIA[name]
    family, entry = kernel.entry.split(".")
    try:                                          # kernel modules import their SDK (triton) at module level
        fn = kernel.function()
    except ModuleNotFoundError as e:
        pytest.skip(f"{kernel.target} needs {e.name}, not installed")
    problems = mismatches(fn, entry_protocol(TABLES[family], entry), exact=False)
    assert not problems, f"{kernel.target}: {problems}"


CASES = {case.name: case for case in all_cases()}


@pytest.mark.parametrize("table, entry", ENTRIES, ids=ENTRY_IDS)
def test_the_conformance_case_calls_the_entry_by_its_protocol(table, entry):
    """The case's oracle is the entry's, and every sample passes arguments the protocol names,
    positional ones no further than its positional parameters; the oracle's result has the
    protocol's return type."""
    case = CASES[f"{table.FAMILY}.{entry}"]
    protocol = entry_protocol(table, entry)
    assert case.reference is getattr(ref, entry_oracle(table, entry))
    params = contract(protocol)
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    names = {p.name for p in params}
    returns = inspect.signature(protocol.__call__).return_annotation
    made = [s for s in case.samples if s.make is not None]
    if case.run is not None and not made:
        return                                    # a runner of its own calls the entry (decode_step)
    for sample in made:
        inputs = sample.make(torch.Generator().manual_seed(0), torch.float32)
        assert len(inputs.args) <= len(positional), f"{sample.shape}: {len(inputs.args)} positional arguments"
        assert set(inputs.kwargs) <= names, f"{sample.shape}: {sorted(set(inputs.kwargs) - names)} not in the protocol"
    result = case.reference(*inputs.args, **inputs.kwargs)
    want = torch.Tensor if returns == "Tensor" else getattr(inspect.getmodule(protocol), returns)
    assert isinstance(result, want), f"{case.name} returns {type(result).__name__}, not {returns}"


def test_every_torch_native_kernel_has_the_protocols_signature():
    """The ppu platform's table (k3.platforms.torch_kernels.native_tables), as built for the CPU."""
    from k3.platforms.torch_kernels.native_tables import SERVED, native_tables

    tables, problems = native_tables("cpu"), {}
    for name in SERVED:
        family, entry = name.split(".")
        kernel = getattr(tables[family], entry)
        problems[name] = mismatches(kernel, entry_protocol(TABLES[family], entry), exact=False)
    assert not any(problems.values()), problems
