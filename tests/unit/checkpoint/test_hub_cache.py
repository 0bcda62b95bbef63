"""Hub repo ids as models (k3.checkpoint.hub), against a hub cache the test lays out on disk
(models--org--name/{refs,snapshots}, as huggingface_hub writes it), with HF_HUB_OFFLINE=1: no
network. Downloads are checked with huggingface_hub's download function replaced."""

import json
from pathlib import Path

import huggingface_hub
import pytest

from k3.checkpoint import hub
from k3.checkpoint.hub import HubError, resolve_model
from k3.cli.main import main
from k3.config import K3Config

REPO = "moonshotai/Kimi-K3"
MAIN, V2 = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """$HF_HOME holding hub/models--moonshotai--Kimi-K3: main = a k3-tiny checkpoint (weights and
    tokenizer), refs/v2 = a k3.1-pro-tiny config only."""
    from k3.cli.checkpoint import init_checkpoint

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--moonshotai--Kimi-K3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    init_checkpoint("k3-tiny", repo / "snapshots" / MAIN, progress=False)
    (repo / "snapshots" / V2).mkdir(parents=True)
    K3Config.preset("k3.1-pro-tiny").to_json_file(repo / "snapshots" / V2 / "config.json")
    return home


@pytest.fixture()
def offline(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_home / "hub" / "models--moonshotai--Kimi-K3" / "snapshots"


def test_repo_id_resolves_from_hf_home(offline):
    path = resolve_model(REPO)
    assert path == offline / MAIN
    assert K3Config.from_pretrained(path) == K3Config.preset("k3-tiny")
    assert any(path.glob("*.safetensors"))


def test_revision_branch_and_commit(offline):
    assert resolve_model(REPO, revision="v2") == offline / V2
    assert K3Config.from_pretrained(resolve_model(REPO, revision="v2")) == K3Config.preset("k3.1-pro-tiny")
    assert resolve_model(REPO, revision=MAIN) == offline / MAIN


def test_download_dir_and_hf_hub_cache_replace_hf_home(offline, monkeypatch, tmp_path):
    cache = offline.parents[1]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    assert resolve_model(REPO, download_dir=cache) == offline / MAIN
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO) == offline / MAIN


def test_missing_offline_is_one_line_with_the_fetch_command(offline, tmp_path):
    with pytest.raises(HubError) as e:
        resolve_model("moonshotai/Kimi-K3-Missing")
    msg = str(e.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and msg.endswith("hf download moonshotai/Kimi-K3-Missing")
    with pytest.raises(HubError) as e:
        resolve_model(REPO, revision="v9", download_dir=tmp_path)
    assert str(e.value).endswith(f"hf download {REPO} --revision v9 --cache-dir {tmp_path}")


def test_local_paths_are_not_repo_ids(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "k3-tiny").mkdir(parents=True)
    assert not hub.is_repo_id("models/k3-tiny")          # exists on disk: a directory, not a repo
    assert resolve_model("models/k3-tiny") == Path("models/k3-tiny")      # returned as given
    assert not hub.is_repo_id("./a/b") and not hub.is_repo_id("/abs/path") and not hub.is_repo_id("a/b/c")
    assert hub.is_repo_id("moonshotai/Kimi-K3.1-Pro")


def test_online_miss_downloads_and_a_failed_download_names_the_command(offline, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    real, calls = huggingface_hub.snapshot_download, []

    def fake(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model(REPO) == offline / MAIN and not calls           # cached: no download
    assert resolve_model("org/new", revision="r1") == tmp_path
    (repo_id, kwargs), = calls
    assert repo_id == "org/new" and kwargs["revision"] == "r1" and kwargs["cache_dir"] == str(offline.parents[1])
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.bin" not in kwargs["allow_patterns"]

    def unreachable(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        raise OSError("Network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(HubError) as e:
        resolve_model("org/new")
    assert "\n" not in str(e.value) and "Network is unreachable" in str(e.value)
    assert str(e.value).endswith("fetch it with: hf download org/new")


def test_cli_commands_take_repo_ids(offline, capsys):
    assert main(["info", "--model", REPO, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_size"] == K3Config.preset("k3-tiny").hidden_size
    assert main(["info", "--model", REPO, "--revision", "v2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_size"] == K3Config.preset("k3.1-pro-tiny").hidden_size
    assert main(["serve", "moonshotai/Kimi-K3-Missing", "--platform", "reference"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("k3: error: ") and "hf download moonshotai/Kimi-K3-Missing" in err


def test_served_name_stays_the_repo_id(offline):
    import argparse

    from k3.cli.common import resolve_model_dir

    args = argparse.Namespace(model=REPO, revision=None, download_dir=None)
    resolve_model_dir(args)
    assert args.model == str(offline / MAIN) and args.model_id == REPO
