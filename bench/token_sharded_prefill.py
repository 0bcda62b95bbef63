"""Token-sharded prefill TTFT against the unsharded prefill (`k3.model.token_sharded`), CPU gloo.

Spawns `--world` gloo processes, each loading the same random checkpoint of `--preset` (written
once by the parent) in `--dtype`, and times for each prompt length:

- `unsharded_ms`: one process's plain prefill of the prompt (one forward call, the other ranks
  waiting at a barrier), median of `--iters`;
- `sharded_ms`: `TokenShardedPrefill.prefill` over all the ranks (the slowest rank counts);
- `token_bytes_per_token`: what one rank received through the token all-gathers (MLA latent
  rows and DSA index keys, its own share and padding included), divided by the prompt length,
  beside `model_token_bytes_per_token`, the same from the shapes (every MLA layer's latent row
  and index key x world); `piece_bytes`: the KDA pieces' maps and conv tails, fixed per
  prompt (16 x H x (K x K + K x V) state words and 16 x (W_conv - 1) conv rows a KDA layer),
  beside `model_piece_bytes`;
- with `--tp` the model is TP-sharded over the ranks and the run is the heads <-> tokens
  variant against the TP prefill (`tp_unsharded_ms`), with `all_to_all_bytes_per_token`
  (rank 0's received bytes of both re-layouts) beside the count from the shapes;
- `max_abs_logit_diff`: the last logits of the two runs (1e-12 in float64; float32 shows the
  re-association of the chained KDA states).

Figures on a shared CPU measure the algorithm's overheads, not a speed-up: the ranks share
its cores. Run: python3 bench/token_sharded_prefill.py --world 4 --lengths 256,1024,4096
Smoke (CI): python3 bench/token_sharded_prefill.py --smoke --out /tmp/tsp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAGE_SIZE = 16
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_ms(fn, iters: int) -> float:
    """The slowest rank's median milliseconds of fn (barrier before each call)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _worker(rank: int, args, port: int, checkpoint: str, out: str) -> None:
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_model
    from k3.model import ParallelContext, TorchDistributedCollectives
    from k3.model.metadata import ForwardMetadata
    from k3.model.token_sharded import PiecePlan, TokenShardedPrefill

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    parallel = ParallelContext.from_torch_distributed() if args.tp else None
    model = load_model(checkpoint, dtype=DTYPES[args.dtype], progress=False, parallel=parallel)
    cfg = model.cfg
    runner = TokenShardedPrefill(model, rank=rank, world=args.world, collectives=TorchDistributedCollectives())
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        pages = -(-length // PAGE_SIZE)
        table = torch.arange(pages, dtype=torch.int32) + 1
        pool = CachePool.for_model(model, 1 + pages, block_size=PAGE_SIZE)
        meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[0], block_table=table[None],
                                     page_size=PAGE_SIZE)
        plain = {}

        def unsharded():            # TP: the TP prefill on every rank; TP = 1: rank 0 alone
            if rank == 0 or args.tp:
                plain["logits"] = model(meta, pool.views).logits

        sharded = {}

        def run_sharded():
            sharded["out"] = runner.prefill(ids, pool.views, block_row=table, state_row=0, page_size=PAGE_SIZE)

        unsharded(), run_sharded()                                         # warm-up
        unsharded_ms = _median_ms(unsharded, args.iters)
        sharded_ms = _median_ms(run_sharded, args.iters)
        diff = torch.zeros(1, dtype=torch.float64)
        if rank == 0:
            diff[0] = (sharded["out"].logits[-1].double() - plain["logits"][-1].double()).abs().max()
        dist.broadcast(diff, 0)
        act = torch.finfo(DTYPES[args.dtype]).bits // 8
        state = 8 if args.dtype == "float64" else 4
        per_token = len(cfg.mla_layer_ids) * cfg.mla_latent_size * act
        if cfg.uses_dsa:
            per_token += len(cfg.mla_layer_ids) * (cfg.index_head_dim + 4)     # fp8 key + fp32 scale
        la = cfg.linear_attn
        per_piece = (la.num_heads * 2 * la.head_dim ** 2 * state
                     + (la.short_conv_kernel_size - 1) * 3 * la.num_heads * la.head_dim * act)
        got = sharded["out"].bytes_gathered
        if args.tp:     # received per token: T_mine x H_local x (R + Dr) from each rank, T x H_local x R back
            n = len(PiecePlan(length, args.world, rank).my_tokens)
            h, r_, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
            model_bytes = len(cfg.mla_layer_ids) * act * (n * h * (r_ + dr) + length * h // args.world * r_)
            rows.append({"length": length, "tp_unsharded_ms": unsharded_ms, "sharded_ms": sharded_ms,
                         "all_to_all_bytes_per_token": got["all_to_all"] / length,
                         "model_all_to_all_bytes_per_token": model_bytes / length,
                         "max_abs_logit_diff": diff.item()})
            continue
        width = max(len(PiecePlan(length, args.world, r).my_tokens) for r in range(args.world))
        rows.append({"length": length, "unsharded_ms": unsharded_ms, "sharded_ms": sharded_ms,
                     "token_bytes_per_token": got["tokens"] / length,
                     "model_token_bytes_per_token": per_token * args.world * width / length,
                     "piece_bytes": got["pieces"], "model_piece_bytes": len(cfg.kda_layer_ids) * 16 * per_piece,
                     "max_abs_logit_diff": diff.item()})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--lengths", default="256,1024,2048", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--tp", action="store_true", help="the model TP-sharded over the ranks (heads <-> tokens "
                    "re-layout), against the TP prefill")
    ap.add_argument("--smoke", action="store_true", help="k3-tiny, 2 ranks, 40 tokens, float64, one iteration")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.world, args.lengths, args.dtype, args.iters = "k3-tiny", 2, [40], "float64", 1
    from k3.cli.checkpoint import init_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(init_checkpoint(args.preset, Path(tmp) / "ckpt", progress=False))
        rows_file = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(args, _free_port(), checkpoint, rows_file), nprocs=args.world, join=True)
        rows = json.loads(Path(rows_file).read_text())
    result = {"bench": "token_sharded_prefill", "preset": args.preset, "world": args.world, "tp": args.tp,
              "dtype": args.dtype,
              "iters": args.iters, "threads_per_rank": args.threads, "cpus": os.cpu_count(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
