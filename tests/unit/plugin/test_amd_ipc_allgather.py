"""The IPC all-gather's protocol (k3.platforms.amd.ipc_allgather) on the CPU: three processes on a
gloo group exchange shared-memory buffers (ipc_transport.SharedMemoryIpc, the stand-in for
HIP / CUDA IPC device memory) and run the same flag / epoch protocol the GPU path runs; every
result is compared with torch.distributed's all_gather on the same random inputs. The GPU
transport (DeviceIpc) has not run here: bench/ipc_allgather.py runs both on GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ipc_allgather_worker.py")


def test_ipc_all_gather_matches_torch_distributed_and_names_a_missing_rank(tmp_path):
    world = 3
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(tmp_path / "rdv"),
                               str(tmp_path / f"out{rank}.json")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for rank in range(world)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    results = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(world)]
    for rank, r in enumerate(results):
        assert r["active"] and r["epoch"] == 18 and len(r["calls"]) == 18
        assert all(call["equal"] for call in r["calls"]), (rank, r["calls"])
        assert r["calls"][0]["shape"] == [9, 5] and r["calls"][1]["shape"] == [4, 21]
        assert not r["accepts_too_large"] and not r["accepts_reduce"]
    for rank in (0, 2):
        assert "rank(s) [1] never published call 19" in results[rank]["timeout"], results[rank]
    assert "timeout" not in results[1]
