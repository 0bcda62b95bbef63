"""`k3 plugins`: every plugin with its hooks and detection, the selection, kernel providers."""

import json

import pytest
import torch

from k3.cli.main import main
from k3.plugin import KERNEL_TABLES

VENDORS = ("nvidia", "amd", "tpu", "ppu")
on_reference = pytest.mark.skipif(torch.cuda.is_available(), reason="expects no detected device (the CI machine)")


def run_json(capsys, *args):
    assert main(["plugins", "--json", *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out)                        # stdout is only JSON


@on_reference
def test_text_lists_every_plugin_hooks_and_providers(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    for name in ("reference", *VENDORS):
        assert f"  {name}  (k3 " in text
    assert text.count("    hooks: ") >= 1 + len(VENDORS)        # one (wrapped) hooks list per plugin
    assert text.count("k3_detect_platform") >= len(VENDORS) and text.count("k3_conformance_expectations") >= len(VENDORS)
    assert "Platform: reference (selected; plugin reference" in text
    assert "  elementwise.rms_norm" in text and "Kernels (entry: provider):" in text


@on_reference
def test_json_report(capsys):
    data = run_json(capsys)
    plugins = {p["name"]: p for p in data["plugins"]}
    assert data["plugins"][0]["name"] == "reference" and set(VENDORS) <= set(plugins)
    assert data["selected"] == {"platform": "reference", "plugin": "reference", "distribution": "k3",
                                "version": plugins["reference"]["version"], "device": "cpu", "forced": False}
    for vendor in VENDORS:
        p = plugins[vendor]
        assert p["distribution"] == "k3" and p["registered"] and p["platform"]["name"] == vendor
        assert "k3_detect_platform" in p["hooks"] and p["platform"]["reason"]
    assert len(plugins["reference"]["hooks"]) >= 15
    entries = sum(len(t.entries()) for t in KERNEL_TABLES)
    assert len(data["kernels"]) == entries
    assert all(k == {"provider": "reference", "fallback": False} for k in data["kernels"].values())
    assert data["capabilities"]["vendor"] == "cpu"


def test_forced_ppu_shows_its_entries_and_the_reference_fallback(capsys):
    from k3.platforms.torch_kernels.native_tables import SERVED

    data = run_json(capsys, "--platform", "ppu")
    assert data["selected"]["platform"] == "ppu" and data["selected"]["forced"]
    assert data["capabilities"]["vendor"] == "t-head"
    served = {name for name, k in data["kernels"].items() if k == {"provider": "ppu", "fallback": False}}
    assert served == set(SERVED)
    assert all(k == {"provider": "reference", "fallback": True} for name, k in data["kernels"].items()
               if name not in served)
    assert data["config_defaults"] == {"gpu_memory_utilization": 0.9, "expert_cache": "auto"}
    assert data["conformance_expectations"][0].endswith("ppu/conformance.toml")
    assert main(["plugins", "--platform", "ppu"]) == 0
    assert "reference (reference fallback)" in capsys.readouterr().out


def test_k3_platform_selects(capsys, monkeypatch):
    monkeypatch.setenv("K3_PLATFORM", "ppu")
    assert run_json(capsys)["selected"]["platform"] == "ppu"


def test_k3_plugins_leaves_plugins_out_and_says_so(capsys, monkeypatch):
    monkeypatch.setenv("K3_PLUGINS", "ppu")
    plugins = {p["name"]: p for p in run_json(capsys)["plugins"]}
    for name in ("nvidia", "amd", "tpu"):
        assert not plugins[name]["registered"] and plugins[name]["reason"] == "left out by K3_PLUGINS"
        assert plugins[name]["hooks"] == [] and plugins[name]["platform"] is None
    assert plugins["ppu"]["registered"] and plugins["reference"]["registered"]
    assert main(["plugins"]) == 0
    assert "  nvidia  (k3 0.1.0)\n    not registered: left out by K3_PLUGINS\n" in capsys.readouterr().out


@pytest.mark.parametrize("name, words", [("nvidia", "k3[nvidia]"), ("amd", "k3[amd]"), ("tpu", "k3[tpu]"),
                                         ("nope", "unknown platform 'nope'")])
def test_selection_errors_are_one_line(capsys, name, words):
    if name in ("nvidia", "amd") and (torch.version.cuda or torch.version.hip):
        pytest.skip("needs a CPU-only torch build")
    assert main(["plugins", "--platform", name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("k3: error: ") and words in err


class _FakeEntryPoint:
    """What k3.platform.discovery reads from an importlib.metadata entry point."""

    def __init__(self, name, load):
        self.name, self._load = name, load
        self.dist = type("Dist", (), {"name": f"k3-{name}", "version": "9.9"})()

    def load(self):
        return self._load()


def test_unsupported_hookspec_version_and_broken_import_are_refused(capsys, monkeypatch):
    import k3.platform.discovery as manager

    class FromTheFuture:
        K3_HOOKSPEC_VERSIONS = (2,)

    def broken():
        raise ImportError("No module named 'k3_broken_sdk'")

    real = manager.entry_points
    fakes = [_FakeEntryPoint("future", lambda: FromTheFuture), _FakeEntryPoint("broken", broken)]
    monkeypatch.setattr(manager, "entry_points", lambda group: [*real(group=group), *fakes])
    plugins = {p["name"]: p for p in run_json(capsys)["plugins"]}
    future, broken_record = plugins["future"], plugins["broken"]
    assert (future["distribution"], future["version"], future["registered"]) == ("k3-future", "9.9", False)
    assert future["reason"] == ("supports hookspec versions (2,), k3 needs 1 "
                                "(declare K3_HOOKSPEC_VERSIONS in the plugin)")
    assert not broken_record["registered"]
    assert broken_record["reason"] == "failed to import: ImportError: No module named 'k3_broken_sdk'"
    assert main(["plugins"]) == 0
    assert "not registered: supports hookspec versions (2,), k3 needs 1" in capsys.readouterr().out
