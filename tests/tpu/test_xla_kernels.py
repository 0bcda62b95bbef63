"""Every kernel entry the tpu plugin backs, run on the XLA device (PJRT CPU) against its
`k3.reference` oracle (float64 on the CPU), with torch-xla's metrics checked: the call traces
into graphs with no CPU fallback (`aten::*` counters) and no device-to-host transfer before
the outputs are read. One sample per entry (the smoke sample, float32), to stay fast."""

import pytest
import torch

from k3.conformance import cases as _cases  # noqa: F401 - registers the cases
from k3.conformance.inputs import clone, to_cpu, to_device
from k3.conformance.registry import Item, _CASES
from k3.conformance.runner import RunContext, compare_outputs, named_outputs, resolve_entry
from k3.conformance.inputs import upcast64


@pytest.fixture(scope="module")
def tpu():
    from k3.platform import select_platform

    return select_platform("tpu")


def _tpu_cases():
    from k3.platforms.tpu import kernels

    backed = {f"{t.FAMILY}.{e}" for t in (kernels.kda_table(), kernels.mla_table(), kernels.indexer_table(),
                                           kernels.moe_table(), kernels.attn_res_table(),
                                           kernels.elementwise_table()) for e in t.provided()}
    return sorted(c.name for c in _CASES.values() if c.entry in backed and c.run is None)


def test_the_plugin_backs_the_decode_path(tpu):
    """The entries of a decode step come from the tpu plugin; prefill entries fall back."""
    prov = tpu.kernels.providers
    for entry in ("mla.decode", "kda.decode_step", "kda.recurrent", "kda.short_conv", "moe.experts",
                  "indexer.paged_decode_scores", "indexer.topk", "elementwise.rms_norm", "attn_res.step"):
        assert prov[entry] == "tpu", (entry, prov[entry])
    assert prov["kda.chunked"] == "tpu"


@pytest.mark.parametrize("name", _tpu_cases())
def test_entry_on_xla_matches_the_reference(tpu, name):
    import torch_xla
    import torch_xla.debug.metrics as met

    case = _CASES[name]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[case.smoke()]
    item = inputs = None
    for sample in case.samples:     # the decode form: packed `cu_seqlens` is read on the host by contract
        item = Item(case, sample, case.smoke())
        inputs = sample.make(torch.Generator().manual_seed(item.seed), dtype)
        if inputs.kwargs.get("cu_seqlens") is None:
            break
    else:
        pytest.fail(f"{name}: no sample without cu_seqlens (the decode form the tpu plugin claims)")
    kernel = resolve_entry(tpu.kernels, case.entry)
    dev = to_device(clone(inputs), torch_xla.device())
    torch_xla.sync()
    met.clear_all()
    result = kernel(*dev.args, **dev.kwargs)
    outs_dev = named_outputs(case, result, dev)
    assert all(t.device.type == "xla" for t in outs_dev.values() if isinstance(t, torch.Tensor))
    torch_xla.sync()
    fallbacks = [c for c in met.counter_names() if c.startswith("aten::")]
    transfers = (met.metric_data("TransferFromDeviceTime") or (0,))[0]
    assert not fallbacks, f"{name}: ops ran on the CPU: {fallbacks}"
    assert transfers == 0, f"{name}: {transfers} device-to-host transfer(s) inside the call"
    outs = to_cpu(outs_dev)
    ref_inputs = upcast64(inputs)
    refs = named_outputs(case, case.reference(*ref_inputs.args, **ref_inputs.kwargs), ref_inputs)
    same = clone(inputs)
    expected = named_outputs(case, case.reference(*same.args, **same.kwargs), same)
    outcome = compare_outputs(item, outs, refs, expected, ref_inputs)
    assert outcome.outputs and all(o.passed for o in outcome.outputs), outcome
