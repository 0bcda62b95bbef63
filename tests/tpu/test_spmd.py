"""SPMD (`k3.platforms.tpu.spmd`): k3-tiny's decode step with TP (heads, MLP columns) and EP
(experts) annotations over a mesh of 4 virtual PJRT CPU devices equals the single-device
forward. The sharded run is a child process (SPMD mode and the device count are per process:
CPU_NUM_DEVICES=4, torch-xla's PJRT CPU device count; XLA_FLAGS' host-platform count too); the
lowered HLO must carry the shardings (annotations: GSPMD adds the collectives when it
partitions at compile time, so the pre-partition HLO has none)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

CHILD = Path(__file__).with_name("spmd_child.py")


def test_sharded_forward_equals_the_single_device_forward(ckpt, tmp_path, capsys):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = tmp_path / "sharded.pt"
    proc = subprocess.run([sys.executable, str(CHILD), str(out), str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("::: spmd")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    hlo = json.loads(lines[-1].split(" ", 2)[2])
    with capsys.disabled():
        print(f"\n::: spmd on PJRT CPU: {hlo['device_count']} devices, {len(hlo['sharded'])} tensors sharded, "
              f"{hlo['annotations']} sharding annotations in the lowered HLO (collectives before partitioning: "
              f"{hlo['collectives']})")
    assert hlo["device_count"] == 4
    assert any("w13" in n for n in hlo["sharded"]) and any("o_proj" in n for n in hlo["sharded"])
    assert any("gate_up_proj" in n for n in hlo["sharded"]) and hlo["annotations"] > 0

    spec = importlib.util.spec_from_file_location("spmd_child", CHILD)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    single, _ = child.decode_logits(str(ckpt), shard=False)
    sharded = torch.load(out)
    assert sharded.shape == single.shape and torch.isfinite(sharded).all()
    torch.testing.assert_close(sharded, single, rtol=1e-4, atol=1e-4)
    assert torch.equal(sharded.argmax(-1), single.argmax(-1))
