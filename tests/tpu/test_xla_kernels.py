"""Every kernel entry, as the tpu plugin serves it, on the XLA device (PJRT CPU) against its
`k3.reference` oracle (float64 on the CPU), one test per conformance sample of every kernel
case (the cases with a runner of their own, cache views and the model, run under
`k3 conformance --platform tpu`).

Each test:
- makes fresh random inputs (the sample's generator, another seed than conformance's);
- poisons every buffer the kernel allocates uninitialised (`torch.empty`, `new_empty`,
  `empty_like` inside the call are filled with NaN, or the lowest integer): on XLA an empty
  buffer is zeros, which would hide an output the kernel forgets to write;
- reads torch-xla's metrics over the call and its graph's execution: no `aten::*` counter (an op
  run on the CPU) and no device-to-host transfer (`TransferFromDeviceTime`) before the outputs
  are read back;
- compares every output with the oracle by the case's comparators (error ratio with an absolute
  floor per dtype, exact for codes and indices), in the smoke dtype for every sample and in
  bfloat16 for the first sample of a case that runs in bfloat16.

`indexer.scores` returns `[T, max kv_len]` by contract: that width, a data-dependent shape, is
the one scalar it reads from the device (exactly one transfer, asserted); with the host int
`max_kv_len` (the tpu kernel's own option) it reads nothing (asserted too).
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from k3.conformance import cases as _cases  # noqa: F401 - registers the cases
from k3.conformance.inputs import TORCH_DTYPES, clone, to_cpu, to_device, upcast64
from k3.conformance.registry import _CASES, Item
from k3.conformance.runner import compare_outputs, named_outputs, resolve_entry

WIDTH_READ = {"indexer.scores": 1}          # device-to-host reads an entry's contract forces (see above)


@pytest.fixture(scope="module")
def tpu():
    from k3.platform import select_platform

    return select_platform("tpu")


def _params():
    out = []
    for name, case in sorted(_CASES.items()):
        if case.run is not None or case.family == "collectives":
            continue
        for i, sample in enumerate(case.samples):
            out.append(pytest.param(name, sample.shape, case.smoke(), id=f"{name}/{sample.shape}-{case.smoke()}"))
            if i == 0 and "bfloat16" in case.dtypes and case.smoke() != "bfloat16":
                out.append(pytest.param(name, sample.shape, "bfloat16", id=f"{name}/{sample.shape}-bfloat16"))
    return out


class PoisonEmpty(TorchFunctionMode):
    """Fills every uninitialised allocation made inside the mode with NaN (floats) or the lowest
    value of its integer dtype: a device op, no transfer."""

    EMPTY = {torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.empty_strided}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EMPTY and isinstance(out, torch.Tensor) and not out.requires_grad:   # not scan's tracing fakes
            if out.is_floating_point():
                out.fill_(float("nan"))
            elif out.dtype not in (torch.bool, torch.uint8):
                out.fill_(torch.iinfo(out.dtype).min)
        return out


def test_every_kernel_entry_is_served_by_the_tpu_plugin(tpu):
    """No entry falls back to the reference plugin (its prefill kernels read the host)."""
    from k3.plugin.tables import KERNEL_TABLES

    entries = [f"{t.FAMILY}.{e}" for t in KERNEL_TABLES for e in t.entries()]
    fallbacks = [e for e in entries if tpu.kernels.providers[e] != "tpu"]
    assert not fallbacks, f"entries served by another plugin: {fallbacks}"


@pytest.mark.parametrize("name,shape,dtype", _params())
def test_entry_on_xla_matches_the_reference(tpu, name, shape, dtype):
    import torch_xla
    import torch_xla.debug.metrics as met

    case = _CASES[name]
    sample = next(s for s in case.samples if s.shape == shape)
    item = Item(case, sample, dtype)
    inputs = sample.make(torch.Generator().manual_seed(item.seed + 7919), TORCH_DTYPES[dtype])
    kernel = resolve_entry(tpu.kernels, case.entry)
    dev = to_device(clone(inputs), torch_xla.device())
    torch_xla.sync()
    met.clear_all()
    with PoisonEmpty():
        result = kernel(*dev.args, **dev.kwargs)
    torch_xla.sync()
    fallbacks = [c for c in met.counter_names() if c.startswith("aten::")]
    transfers = (met.metric_data("TransferFromDeviceTime") or (0,))[0]
    assert all(t.device.type == "xla" for t in _tensors(result)), f"{name}: an output left the XLA device"
    allowed = WIDTH_READ.get(case.entry, 0)
    assert not [c for c in fallbacks if not (allowed and c == "aten::_local_scalar_dense")], \
        f"{name}: ops ran on the CPU: {fallbacks}"
    assert transfers == allowed, f"{name}: {transfers} device-to-host transfer(s) inside the call (allowed {allowed})"

    outs = to_cpu(named_outputs(case, result, dev))
    ref_inputs = upcast64(inputs)
    refs = named_outputs(case, case.reference(*ref_inputs.args, **ref_inputs.kwargs), ref_inputs)
    same = clone(inputs)
    expected = refs if dtype == "float64" else named_outputs(case, case.reference(*same.args, **same.kwargs), same)
    outcome = compare_outputs(item, outs, refs, expected, ref_inputs)
    assert outcome.outputs, f"{name}: nothing compared"
    failed = [o for o in outcome.outputs if not o.passed]
    assert not failed, failed


def test_indexer_scores_with_a_static_width_reads_nothing(tpu):
    """`max_kv_len` (a host int at least every kv_len: the engine's bucket) makes the output width
    static: no transfer, and the first max-kv_len columns equal the contract's output."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from k3 import reference as ref

    g = torch.Generator().manual_seed(3)
    q, w, keys = torch.randn(12, 4, 32, generator=g), torch.rand(12, 4, generator=g), torch.randn(50, 32, generator=g)
    cu_q, cu_kv = torch.tensor([0, 9, 12]), torch.tensor([0, 20, 50])
    dev = torch_xla.device()
    args = [x.to(dev) for x in (q, w, keys)]
    torch_xla.sync()
    met.clear_all()
    out = tpu.kernels.indexer.scores(*args, cu_seqlens_q=cu_q.to(dev), cu_seqlens_kv=cu_kv.to(dev), max_kv_len=64)
    torch_xla.sync()
    assert (met.metric_data("TransferFromDeviceTime") or (0,))[0] == 0
    assert not [c for c in met.counter_names() if c.startswith("aten::")]
    got = out.cpu()
    want = ref.indexer_scores(q.double(), w.double(), keys.double(), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert got.shape == (12, 64) and torch.isneginf(got[:, 30:]).all()
    torch.testing.assert_close(got[:, :30].double(), want, rtol=1e-5, atol=1e-5)


def _tensors(result):
    if isinstance(result, torch.Tensor):
        yield result
    elif isinstance(result, (tuple, list)):
        for r in result:
            yield from _tensors(r)
    elif hasattr(result, "__dataclass_fields__"):
        for f in result.__dataclass_fields__:
            yield from _tensors(getattr(result, f))
