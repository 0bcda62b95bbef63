"""One rank of tests/unit/plugin/test_amd_ipc_allgather.py: gloo group, the IPC all-gather over
shared memory (SharedMemoryIpc) against torch.distributed's all_gather on fresh random inputs.

    python ipc_allgather_worker.py RANK WORLD RENDEZVOUS_FILE OUT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist

from k3.platforms.amd.ipc_allgather import IpcAllGather
from k3.platforms.amd.ipc_transport import SharedMemoryIpc

rank, world, rendezvous, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
torch.set_num_threads(1)
backend = IpcAllGather(transport=SharedMemoryIpc(), capacity=1 << 16, timeout_s=5.0)
results = {"active": backend.active, "calls": []}
g = torch.Generator().manual_seed(1234 + rank)
# shapes / dims / dtypes varying call to call: the epochs must keep every call's data apart
for shape, dim, dtype in [((3, 5), 0, torch.float32), ((4, 7), 1, torch.bfloat16), ((2, 3, 4), 2, torch.float32),
                          ((1, 9), 0, torch.int64), ((64, 32), 1, torch.float32), ((3, 5), 0, torch.float32)] * 3:
    x = (torch.randn(shape, generator=g) * 100).to(dtype)
    want = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(want, x)
    got = backend.all_gather(x, dim)
    results["calls"].append({"equal": bool(torch.equal(got, torch.cat(want, dim))), "shape": list(got.shape)})
results["accepts_too_large"] = backend.accepts("all_gather", torch.empty(1 << 15, dtype=torch.float32))
results["accepts_reduce"] = backend.accepts("all_reduce", torch.empty(4))
results["epoch"] = backend.epoch
# a rank that never joins a call: the others time out naming it
if rank != 1:
    backend.timeout_s = 0.5
    try:
        backend.all_gather(torch.ones(2), 0)
    except RuntimeError as e:
        results["timeout"] = str(e)
dist.barrier()
backend.close()
json.dump(results, open(out, "w"))
dist.destroy_process_group()
