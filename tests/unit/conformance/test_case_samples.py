"""The samples are honest: representable codec inputs really are representable, inputs are
never all zeros, and every kernel case fails when its kernel is wrong (no vacuous case)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from k3 import reference as ref
from k3.conformance.inputs import TORCH_DTYPES, Inputs
from k3.conformance.registry import KERNEL_FAMILIES, all_cases, items
from k3.conformance.runner import RunContext, run_item
from k3.model import reference_kernels
from k3.plugin import Capabilities

KERNEL_ITEMS = [i for i in items("smoke", KERNEL_FAMILIES)]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


@pytest.mark.parametrize("item", [i for i in items("full", KERNEL_FAMILIES)
                                  if i.dtype == "float32" and i.case.run is None], ids=lambda i: i.test_id)
def test_inputs_are_seeded_and_not_all_zero(item):
    """(Cases with their own runner draw their inputs inside it.)"""
    make = lambda: item.sample.make(torch.Generator().manual_seed(item.seed), TORCH_DTYPES[item.dtype])  # noqa: E731
    a, b = make(), make()
    data = [t for t in _tensors((a.args, a.kwargs)) if t.numel() > 1]
    poison = [t for t in data if t.is_floating_point() and t.double().isnan().all()]
    assert len(data) > len(poison)
    for t in data:
        assert any(t is p for p in poison) or t.double().nan_to_num().abs().sum() > 0
    for x, y in zip(_tensors((a.args, a.kwargs)), _tensors((b.args, b.kwargs))):
        assert torch.equal(_bytes(x), _bytes(y))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.flatten().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_representable_codec_samples_round_trip_exactly(dtype):
    """Exactness is only fair on values the codec represents: quantise + dequantise = identity."""
    decode = {"quant.fp8_quantize": lambda o, kw: ref.fp8_dequantize(*o, block_size=kw["block_size"],
                                                                      dtype=torch.float64),
              "quant.mxfp4_quantize": lambda o, kw: ref.mxfp4_dequantize(*o, dtype=torch.float64),
              "quant.nvfp4_quantize": lambda o, kw: ref.nvfp4_dequantize(*o, dtype=torch.float64),
              "indexer.quantize_keys": lambda o, kw: ref.indexer_dequantize_keys(o.values, o.scales, fmt=kw["fmt"],
                                                                                 dtype=torch.float64)}
    checked = 0
    for case in all_cases():
        for sample in case.samples:
            if case.name in decode and "representable" in sample.shape:
                inputs: Inputs = sample.make(torch.Generator().manual_seed(1), TORCH_DTYPES[dtype])
                out = case.reference(*inputs.args, **inputs.kwargs)
                back = decode[case.name](out, inputs.kwargs)
                assert torch.equal(back, inputs.args[0].double()), (case.name, sample.shape)
                checked += 1
    assert checked >= 6


def _perturb(t):
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.uint8:
            return t ^ 1
        if t.is_floating_point():
            return (t.double() * 1.1 + 0.01).to(t.dtype)
        return t + 1
    if dataclasses.is_dataclass(t):                         # named kernel outputs
        return dataclasses.replace(t, **{f.name: _perturb(getattr(t, f.name)) for f in dataclasses.fields(t)})
    if isinstance(t, tuple) and hasattr(t, "_fields"):        # the codecs' named tuples
        return type(t)(*(_perturb(x) for x in t))
    if isinstance(t, (list, tuple)):
        return type(t)(_perturb(x) for x in t)
    return t


def _broken(kernels):
    """Every entry of every table returning perturbed outputs."""
    tables = {}
    for f in dataclasses.fields(kernels):
        table = getattr(kernels, f.name)
        if f.name in ("providers", "batch_invariant"):
            continue
        wrapped = {}
        for entry in table.entries():
            fn = getattr(table, entry)
            wrapped[entry] = (lambda fn: lambda *a, **k: _perturb(fn(*a, **k)))(fn)
        tables[f.name] = dataclasses.replace(table, **wrapped)
    return dataclasses.replace(kernels, **tables)


@pytest.mark.parametrize("item", KERNEL_ITEMS + [i for i in items("smoke", ("cache",))], ids=lambda i: i.id)
def test_a_wrong_kernel_fails_every_case(item):
    platform = SimpleNamespace(kernels=_broken(reference_kernels()), capabilities=Capabilities(fp8_dtype="e4m3fn"),
                               info=SimpleNamespace(device="cpu", plugin="broken"), kda_state_layout="hkv")
    try:
        outcome = run_item(RunContext(platform), item)
    except AttributeError:
        raise                                   # the fake platform lacks something: the case never ran
    except Exception:
        return                                  # a crash is a failure too
    assert not outcome.passed, outcome.summary()
