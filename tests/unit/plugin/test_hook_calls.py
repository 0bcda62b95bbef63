"""Every hook call goes through pluggy: an implementation that declares fewer arguments than
its hookspec offers works ("arguments only grow"), and a platform plugin's hooks answer only
while its platform is the selected one, so no hook needs a platform-name guard."""

import ast
from pathlib import Path

import pytest
import torch

from k3 import reference as ref
from k3.config import K3Config
from k3.plugin import Capabilities, Detection, ElementwiseKernels, KDAKernels, hookimpl
from k3.platform import Platform, PluginRecord, discover, select

ROOT = Path(__file__).resolve().parents[3]


def _platform_with(*plugins, requested="reference") -> Platform:
    found = discover(allow=[])                                   # entry points left out
    for name, plugin in plugins:
        found.pm.register(plugin, name=name)
        found.records[name] = PluginRecord(name, "test", "0", True)
    found.pm.check_pending()
    return Platform(found, select(found, requested))


class _FewerArguments:
    """A kernel-only third-party plugin whose hooks take none of the arguments they are offered."""

    K3_HOOKSPEC_VERSIONS = (1,)

    def __init__(self):
        self.calls = {"chunked": 0, "rms_norm": 0}

    @hookimpl
    def k3_kda_kernels(self):
        def chunked(*args, **kwargs):
            self.calls["chunked"] += 1
            return ref.kda_chunked(*args, **kwargs)

        return KDAKernels(chunked=chunked)

    @hookimpl
    def k3_elementwise_kernels(self):
        def rms_norm(x, weight, eps):
            self.calls["rms_norm"] += 1
            return ref.rms_norm(x, weight, eps)

        return ElementwiseKernels(rms_norm=rms_norm)

    @hookimpl
    def k3_config_defaults(self):
        return {"max_num_seqs": 3}

    @hookimpl
    def k3_validate_config(self, options):                      # a subset of (platform, config, options)
        return [f"max_num_seqs {options['max_num_seqs']} is odd"] if options.get("max_num_seqs", 0) % 2 else []


def test_a_plugin_declaring_fewer_arguments_works_end_to_end(tiny_checkpoint):
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_checkpoint
    from k3.model import contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    plugin = _FewerArguments()
    platform = _platform_with(("fewer", plugin))
    assert platform.kernels.providers["kda.chunked"] == "fewer"
    assert platform.kernels.providers["elementwise.rms_norm"] == "fewer"
    assert platform.kernels.providers["kda.recurrent"] == "reference"
    assert platform.config_defaults()["max_num_seqs"] == 3
    assert platform.validate_config(K3Config.preset("k3-tiny"), {"max_num_seqs": 3}) == ["max_num_seqs 3 is odd"]

    model = platform.build_model(K3Config.preset("k3-tiny"), dtype=torch.float64)
    load_checkpoint(model, tiny_checkpoint("k3-tiny"), progress=False)
    cache = CachePool.for_model(model, 2, block_size=16).views            # a state row, then a page
    meta = ForwardMetadata.build([[1, 2, 3, 4, 5]], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, 1) + 1, page_size=16)
    assert torch.isfinite(model(meta, cache).logits).all()
    assert plugin.calls["chunked"] > 0 and plugin.calls["rms_norm"] > 0


class _Losing:
    """A platform plugin whose platform is unavailable: every hook other than detection fails
    the test if it is ever called."""

    K3_HOOKSPEC_VERSIONS = (1,)

    @hookimpl
    def k3_detect_platform(self):
        return Detection("losing", available=False, reason="never here")

    @hookimpl
    def k3_capabilities(self):
        raise AssertionError("asked a losing platform plugin for capabilities")

    @hookimpl
    def k3_kda_kernels(self):
        raise AssertionError("asked a losing platform plugin for kernels")

    @hookimpl
    def k3_config_defaults(self):
        raise AssertionError("asked a losing platform plugin for defaults")


class _KernelOnlyWithCapabilities:
    """A kernel-only plugin (no platform) that also answers k3_capabilities: capabilities come
    from the selected platform's own plugin, so it is never asked."""

    K3_HOOKSPEC_VERSIONS = (1,)

    @hookimpl(tryfirst=True)
    def k3_capabilities(self):
        raise AssertionError("asked a kernel-only plugin for the platform's capabilities")


def test_only_the_selected_platform_plugin_answers_platform_hooks():
    platform = _platform_with(("losing", _Losing()), ("kernels", _KernelOnlyWithCapabilities()))
    assert platform.name == "reference" and platform.records["losing"].blocked
    assert not platform.records["kernels"].blocked
    assert platform.capabilities.vendor == "cpu"                # the reference's own capabilities
    assert "losing" not in platform.kernels.providers.values()
    assert platform.config_defaults() == {}


class _Forced:
    K3_HOOKSPEC_VERSIONS = (1,)

    @hookimpl
    def k3_detect_platform(self):
        return Detection("forced", available=False, forceable=True, reason="forced only")


def test_a_platform_without_capabilities_gets_none_not_the_references():
    platform = _platform_with(("forced", _Forced()), requested="forced")
    assert platform.name == "forced" and platform.capabilities == Capabilities()


def _name_guards(path: Path) -> list[str]:
    """`x.name ==/!= ...` comparisons in a module: the platform-name checks hooks used to make."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_vendor_and_example_hooks_have_no_platform_name_guards():
    modules = sorted(ROOT.glob("platforms/*/plugin.py")) + [
        ROOT / "tests/plugins/k3-example-plugin/k3_example_plugin/__init__.py",
        ROOT / "core/platform/reference.py"]
    assert len(modules) >= 6
    guards = [g for m in modules for g in _name_guards(m)]
    assert not guards, f"platform-name guards in hook implementations: {guards}"


def test_a_wrapper_on_a_merged_hook_is_refused():
    class Wrapper:
        K3_HOOKSPEC_VERSIONS = (1,)

        @hookimpl(wrapper=True)
        def k3_kda_kernels(self):
            return (yield)

    with pytest.raises(TypeError, match="plugin 'wrapper': k3_kda_kernels is a wrapper"):
        _platform_with(("wrapper", Wrapper()))
