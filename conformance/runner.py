"""Running one test item: the platform's kernel against the float64 oracle.

`run_item` dispatches to the case's own runner (cache views, the model) or to
`run_kernel_item`, which calls the platform's entry on the platform device with the sample's
inputs, runs the reference op on the same inputs upcast to float64 (the oracle) and in the
kernel's dtype (the contract's output dtypes and shapes), and compares every output.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from . import compare as cmp
from .inputs import TORCH_DTYPES, Inputs, clone, poison_freed_memory, synchronize, to_cpu, to_device, upcast64
from .registry import Item


@cache
def scratch_directory() -> Path:
    """One scratch directory per process for contexts made without one, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="k3-conformance-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@dataclass
class RunContext:
    """What runners get: the platform, its device, a scratch directory (default: the process's
    `scratch_directory`) and a per-session cache (tiny checkpoints, reference runs)."""

    platform: Any
    workdir: Path = field(default_factory=scratch_directory)
    cache: dict = field(default_factory=dict)
    # case-name globs whose items run in a process of their own (the platform's conformance.toml
    # [run] isolate option; k3.conformance.isolated)
    isolate: tuple[str, ...] = ()
    isolate_timeout_s: float | None = None      # an isolated item's process is killed after this
    isolate_env: dict = field(default_factory=dict)     # environment set in an isolated item's process

    @property
    def device(self) -> str:
        return self.platform.info.device


def resolve_entry(kernels, entry: str):
    """The platform's callable for "family.entry"."""
    family, name = entry.split(".", 1)
    return getattr(getattr(kernels, family), name)


def provider(platform, entry: str) -> str:
    """Which plugin backs a kernel entry (from Platform.kernels.providers)."""
    return platform.kernels.providers.get(entry, platform.info.plugin)


def implementation(platform, entry: str) -> str:
    """Which function serves a kernel entry: "module:function" under k3 (launch options bound by
    the platform in brackets), or "engine (every served entry)" for the model cases."""
    try:
        fn = resolve_entry(platform.kernels, entry)
    except AttributeError:
        return "engine (every served entry)"
    options = getattr(fn, "keywords", None)
    inner = getattr(fn, "func", fn)
    name = _function_name(inner)
    return name + (f" [{', '.join(f'{k}={_option(v)}' for k, v in options.items())}]" if options else "")


def _function_name(fn) -> str:
    """"module:qualname" of a function, without the k3 / k3.platforms prefix."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    return name.removeprefix("k3.platforms.").removeprefix("k3.")


def _option(value) -> str:
    """A bound launch option as the report shows it: a function by its name (an opt-in kernel's
    `fallback`, with its own options), anything else by repr."""
    if not callable(value):
        return repr(value)
    inner = getattr(value, "func", value)
    options = getattr(value, "keywords", None)
    return _function_name(inner) + (f"({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else "")


def executed_on(platform, entry: str) -> str:
    """Where an entry's work runs: the platform's torch device (an XLA device with its PJRT
    device's name), "(Triton interpreter)" added when
    Triton kernels are interpreted there (TRITON_INTERPRET) and the entry (or, for model cases,
    any entry) is served from k3.platforms.triton_kernels or a vendor's Triton wrapper."""
    import os

    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    device = platform.info.device
    if device.split(":")[0] == "xla":           # which PJRT device: "xla (CPU)", "xla (TPU v6 lite)"
        device += f" ({platform.capabilities.device_name or 'unknown PJRT device'})"
    impl = implementation(platform, entry)
    if impl == "engine (every served entry)":
        triton = any(_k3_triton_served(platform, e)
                     for e, plugin in platform.kernels.providers.items() if plugin != "reference")
    else:
        triton = _k3_triton_served(platform, entry)
    return device + (" (Triton interpreter)" if interpreted and triton else "")


def _k3_triton_served(platform, entry: str) -> bool:
    """Whether a k3 Triton kernel (k3.platforms.triton_kernels or a vendor's wrapper) serves the
    entry: a k3.platforms function outside torch_kernels. A third-party plugin's own function
    is not assumed to be Triton."""
    try:
        fn = resolve_entry(platform.kernels, entry)
    except AttributeError:
        return False
    module = getattr(getattr(fn, "func", fn), "__module__", "") or ""
    return module.startswith("k3.platforms.") and not module.startswith("k3.platforms.torch_kernels")


def named_outputs(case, result, inputs: Inputs) -> dict[str, Any]:
    """The case's outputs: its `outputs` function, else the returned tensor as "out", a kernel's
    named outputs by field (a tuple field as name0, name1...; None fields left out), or a
    tuple's entries as out0, out1..."""
    if case.outputs is not None:
        return case.outputs(result, inputs.args, inputs.kwargs)
    if isinstance(result, torch.Tensor):
        return {"out": result}
    if dataclasses.is_dataclass(result) or hasattr(result, "_fields"):
        fields = result._asdict() if hasattr(result, "_fields") else {
            f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        out: dict[str, Any] = {}
        for name, value in fields.items():
            if isinstance(value, (list, tuple)):
                out.update({f"{name}{j}": v for j, v in enumerate(value)})
            elif value is not None:
                out[name] = value
        return out
    out: dict[str, Any] = {}
    for i, value in enumerate(result):
        if isinstance(value, (list, tuple)):
            out.update({f"out{i}.{j}": v for j, v in enumerate(value)})
        else:
            out[f"out{i}"] = value
    return out


def compare_outputs(item: Item, outs: dict, refs: dict, expected: dict, ref_inputs: Inputs) -> cmp.Outcome:
    """Every reference output against the kernel's, with the case's and sample's comparators."""
    case, tol = item.case, item.case.tolerance(item.dtype)
    outcome = cmp.Outcome()
    for name, ref in refs.items():
        spec = item.sample.compare.get(name, case.compare.get(name))
        if name not in outs:
            outcome.outputs.append(cmp.OutputResult(name, "missing", False, message="the kernel did not return it"))
            continue
        out = outs[name]
        wrong_dtype = cmp.dtype_check(name, out, expected[name].dtype)
        if wrong_dtype:
            outcome.outputs.append(wrong_dtype)
            continue
        if spec == "skip":
            continue
        if callable(spec):
            outcome.outputs.append(spec(name, out, ref, tol, ref_inputs))
        elif spec == "exact" or (spec is None and not ref.is_floating_point()):
            outcome.outputs.append(cmp.exact(name, out, ref))
        else:
            outcome.outputs.append(cmp.close(name, out, ref, tol))
    return outcome


def run_kernel_item(ctx: RunContext, item: Item, inputs: Inputs | None = None) -> cmp.Outcome:
    """One kernel call on the platform against the oracle (see the module docstring).
    inputs: the call's inputs on the CPU (default: the sample's `make`)."""
    case, dtype = item.case, TORCH_DTYPES[item.dtype]
    if inputs is None:
        inputs = item.sample.make(torch.Generator().manual_seed(item.seed), dtype)
    kernel = resolve_entry(ctx.platform.kernels, case.entry)

    dev_inputs = to_device(clone(inputs), ctx.device)
    poison_freed_memory(ctx.device)
    result = kernel(*dev_inputs.args, **dev_inputs.kwargs)
    synchronize(ctx.device)
    outs = to_cpu(named_outputs(case, result, dev_inputs))

    ref_inputs = upcast64(inputs)
    refs = named_outputs(case, case.reference(*ref_inputs.args, **ref_inputs.kwargs), ref_inputs)
    if item.dtype == "float64":
        expected = refs
    else:                                   # the contract's dtypes: the reference in the kernel's dtype
        same = clone(inputs)
        expected = named_outputs(case, case.reference(*same.args, **same.kwargs), same)
    return compare_outputs(item, outs, refs, expected, ref_inputs)


def run_item(ctx: RunContext, item: Item) -> cmp.Outcome:
    """Run one item with its case's runner (default: a single kernel call); in a process of its
    own when the context's `isolate` globs name its case."""
    if ctx.isolate:
        from .expectations import isolated

        if isolated(ctx.isolate, item.case.name):
            from .isolated import run_isolated

            return run_isolated(ctx, item)
    if item.case.run is not None:
        return item.case.run(ctx, item)
    return run_kernel_item(ctx, item)
