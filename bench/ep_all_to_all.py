"""Expert-parallel dispatch + combine time per MoE layer (`k3.model.expert_dispatch`).

Spawns `--world` ranks (NCCL, one GPU each, when CUDA has that many GPUs; gloo CPU processes
otherwise) and times, for each decode batch of T tokens per rank (default 1..64), one MoE
layer's communication at K3's shapes (896 experts top-16, latent rows of 3584 bf16):

- `exact`: `dispatch_combine` with the host-sized all-to-all (counts, one host read, payload,
  reverse payload);
- `static`: the sync-free variant with capacity T (equal blocks of T x top_k rows per peer);
- peers in the same run: `raw_a2a`, one `all_to_all_single` of the exact variant's mean payload
  in equal splits (x2 for dispatch + combine: the communication floor of `exact`), and
  `tp_all_reduce`, the all-reduce of the [T, latent] partials the experts-over-TP path pays
  instead (every rank then holds every token's experts' share).

The experts are replaced by a per-expert scale (expert e: y = (1 + e / E) x), so only the
dispatch is timed, and every result is checked against sum_i w[t, i] (1 + e[t, i] / E) z[t]
computed locally (error ratio in the JSON: a row sent to the wrong expert or back to the wrong
token shows).
Routing is uniform at random (distinct experts per token), the balanced case.

Run: python3 bench/ep_all_to_all.py --world 8 --out bench/results/ep-a2a-h200x8-DATE.json
Smoke (CI): python3 bench/ep_all_to_all.py --smoke --out /tmp/ep.json (2 gloo ranks, tiny).
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


def _route(tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device):
    """Uniform routing: top_k distinct experts per token, softmax weights (fp32)."""
    logits = torch.randn(tokens, num_experts, generator=gen)
    ids = logits.topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen) + 0.5      # not normalised: slots stay distinguishable
    return ids.to(device), weights.to(device)


class _Timer:
    """Median milliseconds of fn over iters (barrier before each; CUDA synchronised)."""

    def __init__(self, cuda: bool, iters: int, warmup: int):
        self.cuda, self.iters, self.warmup = cuda, iters, warmup

    def __call__(self, fn) -> float:
        times = []
        for i in range(self.warmup + self.iters):
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if self.cuda:
                torch.cuda.synchronize()
            if i >= self.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        # every rank's median, the slowest counts (the layer waits for it)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        if self.cuda:
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from k3.model.expert_dispatch import dispatch_combine
    from k3.model.parallel import ExpertParallel, TorchDistributedCollectives

    cuda = args.backend == "nccl"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    ep = ExpertParallel(rank=rank, size=world, collectives=TorchDistributedCollectives())
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(1234 + rank)
    timer = _Timer(cuda, args.iters, args.warmup)

    def run(x, ids, w, dense):          # the experts' stand-in: y = w (1 + e / E) x ([N, L], e = ids)
        return x * (w * (1 + ids / args.experts)).to(x.dtype)

    rows = []
    for t in args.tokens:
        z = torch.randn(t, args.latent, generator=gen).to(device=device, dtype=dtype)   # [T, L]
        ids, weights = _route(t, args.experts, args.top_k, gen, device)                  # [T, k]
        scale = weights.double() * (1 + ids.double() / args.experts)                      # [T, k]
        want = (z.double().unsqueeze(1) * scale.unsqueeze(-1)).sum(1)                     # [T, L]
        row = {"tokens_per_rank": t}
        for name, cap in (("exact", None), ("static", t * args.top_k)):
            fn = lambda: dispatch_combine(z, ids, weights, ep=ep, num_experts=args.experts, run=run,  # noqa: E731
                                          capacity_rows=cap)
            got = fn().double()
            row[f"{name}_error_ratio"] = ((got - want).norm() / want.norm()).item()
            row[f"{name}_ms"] = timer(fn)
        # the exact variant's mean payload per rank, sent in equal splits: its comm floor
        payload = -(-t * args.top_k // world) * world
        x = torch.randn(payload, args.latent, generator=gen).to(device=device, dtype=dtype)
        row["raw_a2a_ms"] = timer(lambda: ep.all_to_all_single(x))
        row["payload_bytes_per_rank"] = x.numel() * x.element_size()
        row["raw_a2a_GBps"] = row["payload_bytes_per_rank"] * (world - 1) / world / row["raw_a2a_ms"] / 1e6
        partial = torch.randn(t, args.latent, generator=gen).to(device=device, dtype=dtype)
        row["tp_all_reduce_ms"] = timer(lambda: dist.all_reduce(partial))
        row["exact_floor_fraction"] = 2 * row["raw_a2a_ms"] / row["exact_ms"]
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks (default: the GPUs, else 2)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64", help="decode tokens per rank, comma-separated")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--latent", type=int, default=3584, help="routed_expert_hidden_size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="2 gloo ranks, 8 experts top-2, latent 64, 3 iterations")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.smoke:
        args.world, args.tokens, args.experts, args.top_k, args.latent = 2, "1,4", 8, 2, 64
        args.iters, args.warmup, gpus = 3, 1, 0
    world = args.world or (gpus if gpus > 1 else 2)
    args.backend = "nccl" if gpus >= world else "gloo"
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.experts % world:
        parser.error(f"--experts {args.experts} does not split over --world {world}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), args, queue), nprocs=world, join=True,
                       start_method="spawn")
    rows = queue.get()
    result = {"bench": "ep_all_to_all", "date": datetime.date.today().isoformat(), "world": world,
              "backend": args.backend, "device": torch.cuda.get_device_name(0) if args.backend == "nccl" else "cpu",
              "torch": torch.__version__, "experts": args.experts, "top_k": args.top_k, "latent": args.latent,
              "dtype": args.dtype, "iters": args.iters, "rows": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(f"{'T/rank':>6} {'exact ms':>9} {'static ms':>9} {'raw a2a ms':>10} {'a2a GB/s':>8} {'TP allreduce ms':>15} "
          f"{'floor':>6}", file=sys.stderr)
    for r in rows:
        print(f"{r['tokens_per_rank']:>6} {r['exact_ms']:>9.3f} {r['static_ms']:>9.3f} {r['raw_a2a_ms']:>10.3f} "
              f"{r['raw_a2a_GBps']:>8.2f} {r['tp_all_reduce_ms']:>15.3f} {r['exact_floor_fraction']:>6.2f}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
