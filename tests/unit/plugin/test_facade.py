"""The facade: reference selection, entry-wise kernel fallback, collectives dispatch."""

import pluggy
import pytest
import torch

from k3 import reference as ref
from k3.config import K3Config
from k3.platforms.torch_kernels.tables import torch_tables
from k3.plugin import KERNEL_TABLES, Detection, ElementwiseKernels, KDAKernels, hookimpl
from k3.platform import Platform, PlatformError, PluginRecord, discover, select, select_platform


def test_reference_is_always_there(monkeypatch):
    monkeypatch.delenv("K3_PLATFORM", raising=False)
    platform = select_platform("reference")
    assert platform.name == "reference" and platform.capabilities.vendor == "cpu"
    for table_cls in KERNEL_TABLES:
        table = getattr(platform.kernels, table_cls.FAMILY)
        assert table.provided() == table_cls.entries()           # every entry resolves
    assert platform.kernels.providers["kda.chunked"] == "reference"
    assert platform.kernels.kda.chunked is torch_tables()["kda"].chunked    # the pure-torch kernel set


def test_unknown_platform_is_a_platform_error():
    with pytest.raises(PlatformError, match="unknown platform 'nope'"):
        select_platform("nope")


class _OverridePlugin:
    """A kernel-only plugin backing one entry (as a third party might)."""

    K3_HOOKSPEC_VERSIONS = (1,)

    def __init__(self):
        self.calls = 0

    @hookimpl
    def k3_elementwise_kernels(self, platform):
        def counting_rms_norm(x, weight, eps):
            self.calls += 1
            return ref.rms_norm(x, weight, eps)

        return ElementwiseKernels(rms_norm=counting_rms_norm)

    @hookimpl
    def k3_kda_kernels(self, platform):
        return None                                              # declines


def _platform_with(plugin, name="override") -> Platform:
    found = discover(allow=[])                                   # entry points left out
    found.pm.register(plugin, name=name)
    found.records[name] = PluginRecord(name, "test", "0", True)
    return Platform(found, select(found, "reference"))


def test_entry_wise_fallback_and_model_runs_unchanged(tiny_checkpoint):
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    plugin = _OverridePlugin()
    platform = _platform_with(plugin)
    assert platform.kernels.providers["elementwise.rms_norm"] == "override"
    assert platform.kernels.providers["elementwise.l2_norm"] == "reference"
    assert platform.kernels.providers["kda.chunked"] == "reference"
    cfg = K3Config.preset("k3-tiny")
    model = platform.build_model(cfg, dtype=torch.float64)
    load_checkpoint(model, tiny_checkpoint("k3-tiny"), progress=False)
    cache = CachePool.for_model(model, 2, block_size=16).views                # a state row, a page
    meta = ForwardMetadata.build([[1, 2, 3]], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, 1) + 1, page_size=16)
    assert torch.isfinite(model(meta, cache).logits).all()
    assert plugin.calls > 0


def test_wrong_table_type_is_named():
    class Bad:
        K3_HOOKSPEC_VERSIONS = (1,)

        @hookimpl
        def k3_kda_kernels(self, platform):
            return ElementwiseKernels()

    with pytest.raises(TypeError, match="plugin 'bad': k3_kda_kernels returned ElementwiseKernels"):
        _platform_with(Bad(), name="bad")


def test_misspelled_hook_is_rejected():
    class Typo:
        @hookimpl
        def k3_kda_kernel(self, platform):   # missing "s"
            return KDAKernels()

    found = discover(allow=[])
    found.pm.register(Typo(), name="typo")
    with pytest.raises(pluggy.PluginValidationError, match="k3_kda_kernel"):
        found.pm.check_pending()


def test_selection_priority_and_ties():
    def plugin(name, available, priority, forceable=False):
        class P:
            K3_HOOKSPEC_VERSIONS = (1,)

            @hookimpl
            def k3_detect_platform(self):
                return Detection(name=name, available=available, reason=f"{name} test", priority=priority,
                                 forceable=forceable)
        return P()

    def found_with(*plugins):
        found = discover(allow=[])
        for p in plugins:
            name = p.k3_detect_platform().name
            found.pm.register(p, name=name)
            found.records[name] = PluginRecord(name, "test", "0", True)
        return found

    found = found_with(plugin("a", True, 10), plugin("b", True, 5), plugin("c", False, 50))
    info = select(found, None)
    assert info.name == "a" and found.records["b"].blocked and found.records["c"].blocked
    assert not found.records["reference"].blocked
    with pytest.raises(PlatformError, match="unavailable: c test"):
        select(found_with(plugin("c", False, 50)), "c")
    info = select(found_with(plugin("f", False, 1, forceable=True)), "f")
    assert info.forced
    with pytest.raises(PlatformError, match="same priority"):
        select(found_with(plugin("x", True, 3), plugin("y", True, 3)), None)


def test_broken_third_party_plugins_are_recorded_not_fatal(monkeypatch):
    """A plugin whose detection raises, or whose hook matches no hookspec, is reported with its
    reason and left out; k3 keeps working."""
    import types

    import k3.platform.discovery as manager

    raising = types.ModuleType("raising_plugin")
    raising.K3_HOOKSPEC_VERSIONS = (1,)

    @hookimpl
    def k3_detect_platform():
        raise RuntimeError("driver exploded")

    raising.k3_detect_platform = k3_detect_platform
    typo = types.ModuleType("typo_plugin")
    typo.K3_HOOKSPEC_VERSIONS = (1,)

    @hookimpl
    def k3_kda_kernel(platform):
        return None

    typo.k3_kda_kernel = k3_kda_kernel

    class EP:
        def __init__(self, name, module):
            self.name, self.module, self.dist = name, module, None

        def load(self):
            return self.module

    monkeypatch.setattr(manager, "entry_points", lambda group: [EP("raising", raising), EP("typo", typo)])
    platform = select_platform()
    assert platform.name == "reference"
    assert "detection failed: RuntimeError: driver exploded" in platform.records["raising"].reason
    assert not platform.records["typo"].registered and "k3_kda_kernel" in platform.records["typo"].reason


def test_collectives_pass_over_a_backend_without_the_op():
    """A backend from before all_to_all_single that accepts every op keeps serving the ops it
    has; all_to_all_single falls through to the next backend that implements it."""
    from k3.platform import DispatchingCollectives

    class Old:
        name = "old"

        def accepts(self, op, tensor):
            return True

        def all_reduce(self, x):
            return x + 1

        def all_gather(self, x, dim):
            return torch.cat([x, x], dim)

    class Full(Old):
        name = "full"

        def all_to_all_single(self, x, output_split_sizes=None, input_split_sizes=None):
            return x.flip(0)

    x = torch.arange(4.0)
    both = DispatchingCollectives([Old(), Full()])
    assert torch.equal(both.all_reduce(x), x + 1)
    assert torch.equal(both.all_to_all_single(x), x.flip(0))
    with pytest.raises(RuntimeError, match="no collective backend accepts all_to_all_single"):
        DispatchingCollectives([Old()]).all_to_all_single(x)
