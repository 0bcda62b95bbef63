"""A damaged safetensors shard is a one-line `CheckpointError` naming the file and what is
wrong with it (and `k3 generate` / `k3 serve` exit 2 with `k3: error: ...`, no traceback),
whether the file is empty, shorter than the header, declares a header longer than itself, or
stops before its tensors' data ends."""

import shutil
import struct
import subprocess
import sys

import pytest
import torch

from k3.checkpoint.loader import CheckpointError, load_model


def _damage(directory, how: str):
    shard = sorted(directory.glob("*.safetensors"))[-1]
    size = shard.stat().st_size
    if how == "empty":
        shard.write_bytes(b"")
    elif how == "100_bytes":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "huge_header":
        shard.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    elif how == "truncated_data":
        shard.write_bytes(shard.read_bytes()[: size - 1000])
    elif how == "not_json_header":
        shard.write_bytes(struct.pack("<Q", 16) + b"this is not json" + b"\0" * 64)
    return shard


CASES = {"empty": "0 bytes, too short for a safetensors file",
         "100_bytes": "header in a 100-byte file: truncated, or not a safetensors file",
         "huge_header": "declares a 1152921504606846976-byte header in a 10-byte file",
         "truncated_data": "not a readable safetensors file: .* \\(truncated download\\?\\)",
         "not_json_header": "not a readable safetensors file"}


@pytest.fixture
def damaged(tiny_checkpoint, tmp_path, request):
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("k3-tiny"), directory)
    return directory, _damage(directory, request.param)


@pytest.mark.parametrize("damaged, message", [(k, v) for k, v in CASES.items()], indirect=["damaged"],
                         ids=list(CASES))
def test_the_error_names_the_file_and_the_fault(damaged, message):
    directory, shard = damaged
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(str(directory), dtype=torch.float32, progress=False)
    assert str(shard) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("damaged", ["truncated_data"], indirect=True)
def test_the_cli_exits_2_with_one_line(damaged):
    directory, shard = damaged
    done = subprocess.run([sys.executable, "-m", "k3", "generate", "--model", str(directory), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "k3: error:" in line]
    assert len(errors) == 1 and str(shard) in errors[0], done.stderr
    assert "Traceback" not in done.stderr
