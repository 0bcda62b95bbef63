"""The NVIDIA plugin's symmetric-memory one-shot all-reduce against NCCL, side by side.

Spawns one NCCL rank per GPU (`--world`, default every GPU) and, for each all-reduce size of a
decode step (bf16 rows of K3's hidden size 7168 for 1-64 tokens, up to the backend's buffer),
checks that `k3.platforms.nvidia.symm_mem.SymmetricMemoryAllReduce` returns NCCL's sum (exact
for 2 ranks; within bf16 rounding for more: the summation order differs) and times both
(median of CUDA-synchronised iterations, the slowest rank). With one GPU it still runs: the
buffer's allocation, rendezvous and the op on a group of one (a check of the API on that torch
build; the timing then means nothing).

Run: python3 bench/symm_mem_allreduce.py --out bench/results/symm-mem-h200xN-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fn, iters: int, group) -> float:
    times = []
    for i in range(iters + 5):
        dist.barrier(group)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from k3.platforms.nvidia.symm_mem import SymmetricMemoryAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    backend = SymmetricMemoryAllReduce(dist.group.WORLD)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)   # [T, d]
        row = {"tokens": tokens, "bytes": x.numel() * x.element_size(), "accepted": backend.accepts("all_reduce", x)}
        if row["accepted"]:
            want = x.clone()
            dist.all_reduce(want)
            got = backend.all_reduce(x)
            row["max_abs_diff_vs_nccl"] = (got.float() - want.float()).abs().max().item()
            row["symm_mem_ms"] = _median_ms(lambda: backend.all_reduce(x), args.iters, dist.group.WORLD)
        y = x.clone()
        row["nccl_ms"] = _median_ms(lambda: dist.all_reduce(y), args.iters, dist.group.WORLD)
        if row["accepted"]:
            row["speedup_vs_nccl"] = row["nccl_ms"] / row["symm_mem_ms"]
        rows.append(row)
    if rank == 0:
        queue.put({"active": backend.active, "max_bytes": backend.max_bytes, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks, one GPU each (default: every GPU)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256", help="rows of --hidden bf16 per all-reduce")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA GPUs (NCCL)")
    world = args.world or torch.cuda.device_count()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), args, queue), nprocs=world, join=True, start_method="spawn")
    result = {"bench": "symm_mem_allreduce", "date": datetime.date.today().isoformat(), "world": world,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "hidden": args.hidden,
              "iters": args.iters, **queue.get()}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
