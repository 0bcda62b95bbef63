"""The NVIDIA plugin's symmetric-memory collectives (one-shot all-reduce, all-gather) against
NCCL, side by side.

Spawns one NCCL rank per GPU (`--world`, default every GPU) and, for each size of a decode step
(bf16 rows of K3's hidden size 7168 for 1-256 tokens, up to the backend's buffer), checks that
`k3.platforms.nvidia.symm_mem.SymmetricMemoryAllReduce` returns NCCL's sum (exact for 2 ranks;
within bf16 rounding for more: the summation order differs) and that
`SymmetricMemoryAllGather` returns NCCL's all-gather exactly (along dim 0, and once along the
last dim), and times each against NCCL (median of CUDA-synchronised iterations, the slowest
rank). With one GPU it still runs: each buffer's allocation, rendezvous and op on a group of
one (a check of the API on that torch build against NCCL's answer; the timing then means
nothing). A backend that does not set up is reported (`active` false) and its rows say so.

Run: python3 bench/symm_mem_allreduce.py --out bench/results/symm-mem-h200xN-DATE.json
     (--ops all_reduce,all_gather by default)
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


def _nccl_gather(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim)


def _all_reduce_row(backend, x: torch.Tensor, iters: int) -> dict:
    row = {"accepted": backend.accepts("all_reduce", x)}
    if row["accepted"]:
        want = x.clone()
        dist.all_reduce(want)
        got = backend.all_reduce(x)
        row["max_abs_diff_vs_nccl"] = (got.float() - want.float()).abs().max().item()
        row["symm_mem_ms"] = _median_ms(lambda: backend.all_reduce(x), iters, dist.group.WORLD)
    y = x.clone()
    row["nccl_ms"] = _median_ms(lambda: dist.all_reduce(y), iters, dist.group.WORLD)
    return row


def _all_gather_row(backend, x: torch.Tensor, iters: int, world: int) -> dict:
    row = {"accepted": backend.accepts("all_gather", x)}
    if row["accepted"]:
        row["equal_to_nccl"] = all(torch.equal(backend.all_gather(x, dim), _nccl_gather(x, dim, world))
                                   for dim in (0, -1))
        row["symm_mem_ms"] = _median_ms(lambda: backend.all_gather(x, 0), iters, dist.group.WORLD)
    out = torch.empty(world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    row["nccl_ms"] = _median_ms(lambda: dist.all_gather_into_tensor(out, x), iters, dist.group.WORLD)
    return row


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from k3.platforms.nvidia.symm_mem import SymmetricMemoryAllGather, SymmetricMemoryAllReduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    classes = {"all_reduce": SymmetricMemoryAllReduce, "all_gather": SymmetricMemoryAllGather}
    backends = {op: classes[op](dist.group.WORLD) for op in args.ops}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    for op, backend in backends.items():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)   # [T, d]
            row = {"op": op, "tokens": tokens, "bytes": x.numel() * x.element_size()}
            row.update(_all_reduce_row(backend, x, args.iters) if op == "all_reduce"
                       else _all_gather_row(backend, x, args.iters, world))
            if row["accepted"]:
                row["speedup_vs_nccl"] = row["nccl_ms"] / row["symm_mem_ms"]
            rows.append(row)
    if rank == 0:
        queue.put({"active": {op: b.active for op, b in backends.items()},
                   "max_bytes": {op: b.max_bytes for op, b in backends.items()}, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks, one GPU each (default: every GPU)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256", help="rows of --hidden bf16 per all-reduce")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--ops", default="all_reduce,all_gather", help="collectives to check and time")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA GPUs (NCCL)")
    world = args.world or torch.cuda.device_count()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.ops = [op for op in args.ops.split(",") if op]
    if set(args.ops) - {"all_reduce", "all_gather"}:
        parser.error(f"--ops takes all_reduce and all_gather, got {args.ops}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), args, queue), nprocs=world, join=True, start_method="spawn")
    result = {"bench": "symm_mem_allreduce", "date": datetime.date.today().isoformat(), "world": world,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "hidden": args.hidden,
              "iters": args.iters, **queue.get()}
    result["problems"] = problems(result)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    for problem in result["problems"]:
        print(f"symm_mem: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def problems(result: dict) -> list[str]:
    """What the correctness checks found wrong (empty: every accepted row equals NCCL's answer;
    all-reduce sums exactly up to 2 ranks, all-gathers exactly always; every backend set up)."""
    out = [f"{op}: the symmetric-memory backend did not set up" for op, on in result["active"].items() if not on]
    for row in result["rows"]:
        if not row["accepted"]:
            continue
        if row["op"] == "all_gather" and not row["equal_to_nccl"]:
            out.append(f"all_gather of {row['tokens']} rows differs from NCCL's")
        if row["op"] == "all_reduce" and result["world"] <= 2 and row["max_abs_diff_vs_nccl"] != 0:
            out.append(f"all_reduce of {row['tokens']} rows differs from NCCL's by {row['max_abs_diff_vs_nccl']}")
    return out


if __name__ == "__main__":
    sys.exit(main())
