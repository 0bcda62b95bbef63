"""The nvidia platform in the batch-invariant mode, resolved on the CPU (the selection logic;
tests/kernels/test_nvidia_invariant_kernels.py runs the kernels): every entry of every family is
marked and comes from the nvidia plugin, its own invariant Triton kernels where it has them
(and Triton is installed and the kernel not disabled), the torch invariant kernels elsewhere, so
the mode is not refused; outside the mode nothing changes."""

from __future__ import annotations

import pytest

from k3.platform import Platform, PluginRecord, discover
from k3.platforms.nvidia import capabilities, invariant
from k3.platforms.nvidia import plugin as nvidia_plugin
from k3.platforms.torch_kernels.invariant import invariant_tables
from k3.plugin import KERNEL_TABLES, Capabilities, is_batch_invariant
from k3.plugin.types import PlatformInfo


def _nvidia(monkeypatch, *, batch_invariant: bool) -> Platform:
    monkeypatch.setattr(capabilities, "read", lambda: Capabilities(vendor="nvidia"))      # no GPU here
    found = discover(allow=[])
    found.pm.register(nvidia_plugin, name="nvidia")
    found.records["nvidia"] = PluginRecord("nvidia", "k3", "0", True)
    info = PlatformInfo(name="nvidia", plugin="nvidia", distribution="k3", version="0", device="cuda", forced=True)
    return Platform(found, info, batch_invariant=batch_invariant)


def test_every_entry_is_marked_and_served_by_the_plugin(monkeypatch):
    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    platform = _nvidia(monkeypatch, batch_invariant=True)
    kernels = platform.kernels
    assert kernels.batch_invariant
    served = invariant.served()
    for table in KERNEL_TABLES:
        for entry in table.entries():
            name = f"{table.FAMILY}.{entry}"
            fn = getattr(getattr(kernels, table.FAMILY), entry)
            assert is_batch_invariant(fn) and kernels.providers[name] == "nvidia", name
            want = (invariant.OWN[name][0] if served[name] == "nvidia triton"
                    else getattr(invariant_tables()[table.FAMILY], entry))
            assert fn.__wrapped__ is want, name
    triton = pytest.importorskip("triton", reason="without Triton every entry is the torch invariant kernel")
    assert triton and {n for n, s in served.items() if s == "nvidia triton"} == set(invariant.OWN)


def test_a_disabled_kernel_hands_its_entry_to_the_torch_invariant_one(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("K3_NVIDIA_DISABLE", "rms_norm,moe_router")
    kernels = _nvidia(monkeypatch, batch_invariant=True).kernels
    assert kernels.elementwise.rms_norm.__wrapped__ is invariant_tables()["elementwise"].rms_norm
    assert kernels.moe.select_experts.__wrapped__ is invariant_tables()["moe"].select_experts
    assert kernels.elementwise.glu_activation.__wrapped__ is invariant.glu_activation


def test_outside_the_mode_the_served_kernels_are_unchanged(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("K3_NVIDIA_DISABLE", raising=False)
    monkeypatch.delenv("K3_NVIDIA_EXPERIMENTAL", raising=False)
    kernels = _nvidia(monkeypatch, batch_invariant=False).kernels
    assert not kernels.batch_invariant and not is_batch_invariant(kernels.elementwise.rms_norm)
    assert kernels.moe.experts.__module__ == "k3.platforms.triton_kernels.moe_mxfp4"
    assert kernels.providers["dense.linear"] == "reference"
    assert kernels.providers["lora.delta"] == "nvidia" and kernels.providers["lora.experts"] == "nvidia"
