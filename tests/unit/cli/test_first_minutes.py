"""The first minutes of a new user (issue 28 item 7): help and argument errors answer without
importing torch, a bad flag shows the subcommand's usage with a "did you mean", abbreviations
are refused, and a missing model directory reads the same in every command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k3.cli.main import main

# runs `k3 ARGV` in a fresh interpreter and prints whether torch got imported
CHILD = """
import json, sys
from k3.cli.main import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["serve", "m", "--max-model-lenn", "4"],
                                  ["plan", "--preset", "k3-tiny", "--kv-cache-dtype", "fp16"]],
                         ids=["k3-help", "serve-help", "serve-bad-flag", "plan-bad-value"])
def test_help_and_argument_errors_do_not_import_torch(argv):
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], capture_output=True, text=True, timeout=60)
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH", r.stderr


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_flag_shows_the_subcommands_usage_and_a_hint(capsys):
    err = _usage_error(capsys, ["serve", "m", "--max-model-lenn", "4"])
    assert err.startswith("usage: k3 serve ")
    assert "unrecognized arguments: --max-model-lenn 4 (did you mean --max-model-len?)" in err
    err = _usage_error(capsys, ["plan", "--preset", "k3-tiny", "--tensor-paralel-size", "2"])
    assert err.startswith("usage: k3 plan ") and "(did you mean --tensor-parallel-size?)" in err


def test_misspelt_required_option_gets_a_hint(capsys):
    err = _usage_error(capsys, ["generate", "--modle", "x", "--prompt", "a"])
    assert err.startswith("usage: k3 generate ") and "unrecognized --modle (did you mean --model?)" in err


def test_abbreviations_are_refused(capsys):
    err = _usage_error(capsys, ["serve", "m", "--max-model", "4"])
    assert err.startswith("usage: k3 serve ") and "unrecognized arguments: --max-model" in err


def test_unknown_command_and_choice_hints(capsys):
    assert "(did you mean serve?)" in _usage_error(capsys, ["serv", "m"])
    err = _usage_error(capsys, ["info", "--preset", "k3-tinny"])
    assert err.startswith("usage: k3 info ") and "(did you mean k3-tiny?)" in err


@pytest.mark.parametrize("argv", [["serve", "MISSING"], ["generate", "--model", "MISSING", "--prompt", "x"],
                                  ["info", "--model", "MISSING"], ["plan", "--model", "MISSING"]],
                         ids=["serve", "generate", "info", "plan"])
def test_missing_model_reads_the_same_everywhere(capsys, tmp_path, argv):
    missing = str(tmp_path / "nope")
    assert main([missing if a == "MISSING" else a for a in argv]) == 2
    assert capsys.readouterr().err == f"k3: error: {missing} is not a checkpoint directory (no config.json there)\n"
