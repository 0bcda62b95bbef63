"""What the multi-process model tests share: one launch of W worker processes (gloo) running
every job of a module, and the one-thread fixture (tiny float64 ops run ~30x faster on one
intra-op thread than on two on a shared 2-core box)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_ranks(worker: Path | str, jobs: list[dict], work: Path, world: int, timeout: float = 300) -> list[dict]:
    """Run `worker RANK RENDEZVOUS OUT JOBS.json` on `world` processes at once; returns each
    rank's saved results (OUT.RANK.pt). Raises with every worker's log if one fails."""
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(work / "rendezvous"), str(work / "out"),
                               str(work / "jobs.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for rank in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise AssertionError(f"a worker of {Path(worker).name} failed:\n" + "\n".join(logs))
    return [torch.load(work / f"out.{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the module (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
