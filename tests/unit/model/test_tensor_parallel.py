"""TP = 2 (two processes, gloo) gives the logits of TP = 1 (float64)."""

import subprocess
import sys
from pathlib import Path

import torch

from k3.checkpoint.loader import load_model
from model_runs import teacher_forced

WORKER = Path(__file__).with_name("tp_worker.py")


def test_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    presets = ["k3.1-pro-tiny", "kimi-linear-tiny"]
    paths = [str(tiny_checkpoint(p)) for p in presets]
    prompts = [[(7 * i + 3) % 384 for i in range(n)] for n in (21, 8)]
    encoded = ";".join(",".join(map(str, p)) for p in prompts)
    out = tmp_path / "tp2.pt"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(tmp_path / "rendezvous"),
                               str(out), encoded, *paths], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    tp2 = torch.load(out)
    for path in paths:
        tp1 = teacher_forced(load_model(path, dtype=torch.float64, progress=False), prompts, chunk=6)
        for a, b in zip(tp1, tp2[path]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-9)
