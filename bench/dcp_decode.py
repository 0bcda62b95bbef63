"""Decode context parallelism on the CPU (gloo): decode step time and attention bytes stored per
token per rank, for DCP = 1, 2, 4 (`k3.model.dcp_attention`, `k3.model.dcp_topk`).

For each DCP size W, spawns W gloo processes. Each loads the same random tiny checkpoint
(`--preset`, default k3.1-pro-tiny with its DSA indexer; bf16 latents, fp8 index keys as the
planner's defaults), prefills one `--context`-token prompt in one call, then runs `--steps`
greedy decode steps (`--batch` identical sequences), timing each step (the median goes in the
JSON). It records:
- `decode_step_ms`: the median step on rank 0 (wall time, all W processes on the same cores);
- `stored_bytes_per_token_per_rank`: the latent rows and index keys this rank wrote over all
  MLA layers (counted by the DCP record: `DCPStats.stored_rows`, times each record's bytes in
  the pool) divided by the sequence's tokens, the most over ranks;
- `planner_bytes_per_token_per_rank`: `k3.cache.records.attention_bytes_per_token` / W, the
  figure behind `k3 plan`'s DCP capacity;
- `resent_rows` and `topk_calls` of the distributed top-k;
- `tokens`: rank 0's greedy tokens, and whether they equal DCP = 1's (bf16: the combine and the
  unsharded path may round differently, so a mismatch is reported, not an error);
- `topk_wire_bytes_per_call`: the bytes rank 0 sent in the top-k's all-gathers per call (the
  one-word format of `k3.model.dcp_topk_packed`) and `tie_rows` (rows that took its exact round).
And, in one process over simulated ranks (`wire`: the DSA indexer's top-`--wire-topk` of one
query over `--wire-context` tokens, fp32 scores from a normal distribution, `--wire-rows` rows),
for W = 2, 4, 8, the bytes one rank sends per query: the lossless two-word format
(`k3.model.dcp_topk`: 8 bytes a candidate) against the one-word format (4 bytes), round 1 alone
and with the resend and exact rounds, and how many rows took each round; for normal scores and
for the tie worst case (`scores` "allequal": every score equal; "halfequal": half the tokens
tied at the cut-off), where every rank resends and the one-word format's exact round sends
`topk` lossless words a row.

Run: python3 bench/dcp_decode.py --out bench/results/dcp-decode-cpu-DATE.json
Smoke (CI): python3 bench/dcp_decode.py --smoke --out /tmp/dcp.json (W = 1, 2; 40 tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAGE = 16


def _rank_main(rank: int, world: int, init: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from k3.cache.pool import CachePool
    from k3.checkpoint.loader import load_model
    from k3.engine.runner import ModelRunner
    from k3.model import ParallelContext, contiguous_block_table
    from k3.model.metadata import ForwardMetadata

    parallel = ParallelContext.from_groups(dcp_group=dist.group.WORLD) if world > 1 else ParallelContext()
    model = load_model(args["checkpoint"], dtype=torch.bfloat16, parallel=parallel, progress=False)
    n, total = args["batch"], args["context"] + args["steps"]
    pages = -(-total // PAGE)
    cache = CachePool.for_model(model, n * (1 + pages), block_size=PAGE)
    runner = ModelRunner(model, cache, block_size=PAGE, vocab_size=model.cfg.vocab_size, device="cpu")
    table = contiguous_block_table(n, pages) + n
    prompt = [(11 * i + 5) % model.cfg.vocab_size for i in range(args["context"])]

    def step(new: list[list[int]], done: int) -> torch.Tensor:
        meta = ForwardMetadata.build(new, context_lens=[done] * n, state_indices=list(range(n)), block_table=table,
                                     page_size=PAGE)
        return runner.forward(meta).logits

    logits = step([prompt] * n, 0)
    tokens, times, done = [], [], args["context"]
    for _ in range(args["steps"]):
        nxt = int(logits[0].argmax())
        tokens.append(nxt)
        dist.barrier()
        start = time.perf_counter()
        logits = step([[nxt]] * n, done)
        times.append(time.perf_counter() - start)
        done += 1
    stats = parallel.dcp.stats if parallel.dcp is not None else None
    views = cache.views
    latent = views.latent[0].pages
    record = latent.shape[-1] * latent.element_size()
    if views.index_keys:
        keys = views.index_keys[0]
        record += (keys.values.shape[-1] * keys.values.element_size()
                   + keys.scales[0, 0].numel() * keys.scales.element_size())
    rows = stats.stored_rows if stats else done * n * len(model.cfg.mla_layer_ids)
    result = {"rank": rank, "step_ms": statistics.median(times) * 1e3, "tokens": tokens,
              "stored_bytes_per_token": rows * record / (done * n),
              "topk_wire_bytes_per_call": stats.topk_wire_bytes / max(stats.topk_calls, 1) if stats else 0,
              "tie_rows": stats.tie_rows if stats else 0,
              "resent_rows": stats.resent_rows if stats else 0, "topk_calls": stats.topk_calls if stats else 0}
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, args: dict, work: Path) -> list[dict]:
    init, out = work / f"rdv-{world}", work / f"out-{world}"
    mp.start_processes(_rank_main, args=(world, str(init), args, str(out)), nprocs=world, start_method="spawn")
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]


def wire_rows(topk: int, context: int, rows: int, worlds=(2, 4, 8), scores_kind: str = "normal") -> list[dict]:
    """The top-k's bytes per query per rank, lossless two-word against one-word candidates
    (simulated ranks in one process; fp32 scores, seed 0): "normal" scores, or the tie worst
    case ("allequal", "halfequal": `tie_worst_case_scores`, every score at the cut-off tied
    across ranks)."""
    from k3.model.dcp_topk import candidate_count, simulate_distributed_topk
    from k3.model.dcp_topk_packed import gathered_selection, simulate_packed_topk, tie_worst_case_scores

    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(rows, context, generator=g) if scores_kind == "normal"
              else tie_worst_case_scores(scores_kind, rows, context, topk, g).float())
    out = []
    for world in worlds:
        lossless = simulate_distributed_topk(scores, topk=topk, world=world)
        packed = simulate_packed_topk(scores, topk=topk, world=world)
        assert torch.equal(gathered_selection(packed, scores, topk), lossless.indices)     # exact, same selection
        c = candidate_count(topk, world)
        out.append({"dcp": world, "candidates": c, "round1_lossless_bytes": c * 8, "round1_packed_bytes":
                    packed[0].round1_bytes / rows, "total_lossless_bytes": lossless.wire_bytes / rows,
                    "total_packed_bytes": packed[0].wire_bytes / rows, "resent_rows": packed[0].resent_rows,
                    "tie_rows": packed[0].tie_rows, "rows": rows, "scores": scores_kind})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="k3.1-pro-tiny")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--wire-topk", type=int, default=2048)
    parser.add_argument("--wire-context", type=int, default=131072)
    parser.add_argument("--wire-rows", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="W = 1, 2; a 40-token context, 3 steps; wire: top-64 "
                                                              "of 2,048")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    if ns.smoke:
        ns.context, ns.steps, ns.batch, ns.worlds = 40, 3, 1, "1,2"
        ns.wire_topk, ns.wire_context, ns.wire_rows = 64, 2048, 2
    from k3.cache.records import attention_bytes_per_token
    from k3.checkpoint.random_init import random_checkpoint
    from k3.checkpoint.writer import write_checkpoint
    from k3.config import K3Config

    cfg = K3Config.preset(ns.preset)
    planner = attention_bytes_per_token(cfg, kv_cache_dtype="bf16", index_cache_dtype="fp8")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_checkpoint(work / "ckpt", cfg, random_checkpoint(cfg, seed=0), max_shard_bytes=256 * 1024)
        args = {"checkpoint": str(work / "ckpt"), "context": ns.context, "steps": ns.steps, "batch": ns.batch}
        runs = []
        for world in map(int, ns.worlds.split(",")):
            ranks = run(world, args, work)
            runs.append({"dcp": world, "decode_step_ms": ranks[0]["step_ms"],
                         "stored_bytes_per_token_per_rank": max(r["stored_bytes_per_token"] for r in ranks),
                         "planner_bytes_per_token_per_rank": planner / world,
                         "resent_rows": ranks[0]["resent_rows"], "topk_calls": ranks[0]["topk_calls"],
                         "tie_rows": ranks[0]["tie_rows"],
                         "topk_wire_bytes_per_call": ranks[0]["topk_wire_bytes_per_call"],
                         "tokens": ranks[0]["tokens"]})
    for r in runs:
        r["tokens_equal_dcp1"] = r["tokens"] == runs[0]["tokens"]
    result = {"bench": "dcp_decode", "date": datetime.date.today().isoformat(), "preset": ns.preset,
              "context": ns.context, "steps": ns.steps, "batch": ns.batch, "device": "cpu (gloo)",
              "planner_bytes_per_token": planner, "runs": runs,
              "wire": {"topk": ns.wire_topk, "context": ns.wire_context,
                       "rows": [r for kind in ("normal", "allequal", "halfequal")
                                for r in wire_rows(ns.wire_topk, ns.wire_context, ns.wire_rows, scores_kind=kind)]}}
    Path(ns.out).write_text(json.dumps(result, indent=1))
    for r in runs:
        print(f"DCP {r['dcp']}: decode step {r['decode_step_ms']:.2f} ms, stored "
              f"{r['stored_bytes_per_token_per_rank']:.1f} B/token/rank (planner {r['planner_bytes_per_token_per_rank']:.1f}), "
              f"resent rows {r['resent_rows']}, tokens equal DCP 1: {r['tokens_equal_dcp1']}", file=sys.stderr)
    for r in result["wire"]["rows"]:
        print(f"top-{ns.wire_topk} of {ns.wire_context} ({r['scores']} scores) at DCP {r['dcp']}: round 1 "
              f"{r['round1_lossless_bytes']} -> "
              f"{r['round1_packed_bytes']:.0f} B/query/rank; all rounds {r['total_lossless_bytes']:.0f} -> "
              f"{r['total_packed_bytes']:.0f} B (rows resent {r['resent_rows']}, exact-round rows {r['tie_rows']} "
              f"of {r['rows']})", file=sys.stderr)


if __name__ == "__main__":
    main()
