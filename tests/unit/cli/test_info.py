"""`k3 info`: report, JSON on stdout only, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli.main import main
from k3.presets import PRESETS, preset_dict


@pytest.mark.parametrize("name", list(PRESETS))
def test_info_json_is_only_json(name, capsys):
    assert main(["info", "--preset", name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_hidden_layers"] == len(out["layer_types"])


def test_info_k3_text(capsys):
    assert main(["info", "--preset", "kimi-k3"]) == 0
    text = capsys.readouterr().out
    assert "MLA layers (0-based): 3, 7," in text and "91-92" in text and "896 experts top-16" in text


def test_info_from_checkpoint_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("kimi-k3.1-pro")))
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dsa"]["index_topk"] == 2048


def test_bad_config_is_one_line_error(tmp_path, capsys):
    raw = preset_dict("k3-tiny")
    raw["text_config"]["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "text_config.hidden_act" in err and "Traceback" not in err and err.count("\n") == 1


def test_console_script_runs():
    script = Path(sys.executable).with_name("k3")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "k3.cli.main"]
    done = subprocess.run(cmd + ["info", "--preset", "k3-tiny", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["family"] == "Kimi K3"
