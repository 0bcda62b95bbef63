"""k3's shipped fla-core launch configurations (platforms/triton_kernels/fla_configs.py): which
folder a GPU gets, that the user's own FLA settings win, and the bundle round trip. fla-core's
reading of the files is checked on the GPU by the kda.chunked conformance run."""

import json
import logging
import os
from pathlib import Path

import pytest

from k3.platforms.triton_kernels import fla_configs


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(fla_configs, "_pinned", [])
    monkeypatch.setattr(fla_configs, "ROOT", tmp_path)
    for name in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):     # recorded, so pin()'s writes are undone
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return tmp_path


def test_folder_names_follow_fla_core():
    assert fla_configs.gpu_folder_name("NVIDIA H200") == "NVIDIA_H200"
    assert fla_configs.gpu_folder_name("AMD Instinct MI300X (gfx942)") == "AMD_Instinct_MI300X_gfx942"


def test_pins_the_gpus_folder_once(fresh, monkeypatch):
    (fresh / "NVIDIA_H200").mkdir()
    assert fla_configs.pin("NVIDIA H200") == fresh / "NVIDIA_H200"
    assert os.environ["FLA_CONFIG_DIR"] == str(fresh / "NVIDIA_H200") and os.environ["FLA_CACHE_MODE"] == "full"
    monkeypatch.delenv("FLA_CONFIG_DIR")
    assert fla_configs.pin("NVIDIA H200") == fresh / "NVIDIA_H200"     # decided once per process
    assert "FLA_CONFIG_DIR" not in os.environ


def test_user_settings_win(fresh, monkeypatch):
    (fresh / "NVIDIA_H200").mkdir()
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert fla_configs.pin("NVIDIA H200") is None


def test_a_gpu_without_configs_is_told_how_to_make_them(caplog):
    with caplog.at_level(logging.WARNING):
        assert fla_configs.pin("NVIDIA H100 80GB HBM3") is None
    assert "autotune on first use" in caplog.text and "fla_configs --out" in caplog.text


def test_unpack_writes_one_file_per_kernel(fresh, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("bundle") / "b.json"
    content = {"kernel_name": "k", "gpu": "NVIDIA H200", "autotune_entries": {}, "default_config": {"num_warps": 4}}
    bundle.write_text(json.dumps({"k": content, "j": {**content, "kernel_name": "j"}}))
    folder = fla_configs.unpack(bundle)
    assert folder == fresh / "NVIDIA_H200" and sorted(p.name for p in folder.iterdir()) == ["j.json", "k.json"]
    assert json.loads((folder / "k.json").read_text()) == content
    bundle.write_text(json.dumps({"k": content, "j": {**content, "gpu": "NVIDIA H100"}}))
    with pytest.raises(SystemExit, match="one GPU"):
        fla_configs.unpack(bundle)


def test_the_h200_configs_ship_with_the_package():
    import k3.platforms.triton_kernels as package

    folder = Path(package.__file__).parent / "fla_configs" / "NVIDIA_H200"
    files = sorted(folder.glob("*.json"))
    assert files, folder
    for f in files:
        data = json.loads(f.read_text())
        assert data["kernel_name"] == f.stem and data["default_config"]["num_warps"] > 0
