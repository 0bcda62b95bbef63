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


def test_real_preset_parameter_counts(tmp_path, capsys):
    assert main(["info", "--preset", "kimi-k3", "--json"]) == 0
    k3 = json.loads(capsys.readouterr().out)
    assert abs(k3["total_parameters"] / 2.78e12 - 1) < 0.005          # ~2.78T (report: 2.8T)
    assert abs(k3["active_parameters"] / 104e9 - 1) < 0.01            # ~104B active
    assert k3["cache"]["attention_bytes_per_token"]["fp8"] == 13_824
    assert k3["cache"]["kda_state_bytes_per_request"] == 69 * (96 * 128 * 128 * 4 + 3 * 12288 * 3 * 2)
    (tmp_path / "config.json").write_text((Path(__file__).parents[2] / "fixtures" / "kimi-k3-config.json").read_text())
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert from_dir["total_parameters"] == k3["total_parameters"]
    assert from_dir["active_parameters"] == k3["active_parameters"]
    # K3.1 Pro = K3 + a DSA indexer on each of the 24 MLA layers: wq_b [32*128, 1536], wk [128, 7168],
    # k_norm weight and bias [128], weights_proj [32, 7168]; all active
    assert main(["info", "--preset", "kimi-k3.1-pro", "--json"]) == 0
    pro = json.loads(capsys.readouterr().out)
    indexer = 24 * (32 * 128 * 1536 + 128 * 7168 + 2 * 128 + 32 * 7168)
    assert pro["total_parameters"] - k3["total_parameters"] == indexer
    assert pro["active_parameters"] - k3["active_parameters"] == indexer
    # k3-slice: 12 layers of real K3 width (the single-GPU benchmark model)
    assert main(["info", "--preset", "k3-slice", "--json"]) == 0
    slice_ = json.loads(capsys.readouterr().out)
    assert 55e9 < slice_["total_parameters"] < 58e9 and 14e9 < slice_["active_parameters"] < 15e9
    assert main(["info", "--preset", "kimi-linear-48b-a3b", "--json"]) == 0
    lin = json.loads(capsys.readouterr().out)
    assert 47e9 < lin["total_parameters"] < 50e9 and 2.8e9 < lin["active_parameters"] < 3.3e9   # "48B-A3B"


def test_real_preset_info_is_fast_and_small():
    """The 2.78T-parameter graph is built on the meta device: seconds and well under 1 GiB.

    Memory is measured as growth of the peak RSS over a warm-up `k3 info` of the tiny preset, which
    has already imported torch, k3 and the plugins: a CUDA build of torch maps several GiB of
    libraries at import, so the absolute figure says nothing about the graph."""
    code = ("import io, contextlib, resource, sys, time; from k3.cli.main import main; "
            "contextlib.redirect_stdout(io.StringIO()).__enter__(); "
            "main(['info', '--preset', 'k3-tiny', '--json']); "
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; t = time.time(); "
            "main(['info', '--preset', 'kimi-k3.1-pro', '--json']); "
            "print(time.time() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, growth_kib = map(float, done.stderr.split()[-2:])
    assert seconds < 30 and growth_kib < 512 * 1024, (seconds, growth_kib)
