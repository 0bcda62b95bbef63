"""One of the 4 ranks of test_token_sharded_prefill.py (gloo, file rendezvous, float64):

    python tsp_worker.py RANK INIT_FILE OUT JOBS_JSON

JOBS_JSON: a list of {"checkpoint", "world", "tp", "length", "seed", "all_logits", "decode"};
ranks below `world` prefill the job's prompt token-sharded over the group of ranks [0, world)
(the others skip it), with the whole model on each rank, or ("tp") the model sharded over that
group as its TP group; then rank 0 decodes `decode` greedy tokens from its cache (under TP all
the group's ranks decode together, as TP does). Writes OUT.RANK.pt:
{job index: {"logits", "cache" (`cache_snapshot`), "bytes", and on rank 0 "tokens",
"decode_logits"}}. The helpers are shared with the test (the unsharded reference).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.model import K3ForCausalLM, ParallelContext, TorchDistributedCollectives
from k3.model.metadata import ForwardMetadata
from k3.model.token_sharded import TokenShardedPrefill

WORLD = 4
PAGE_SIZE = 16
STATE_ROW = 0


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """A fresh random prompt (not a pattern the model could shortcut)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def new_cache(model: K3ForCausalLM, tokens: int) -> tuple[CachePool, torch.Tensor]:
    """A pool with the state row 0 and pages after it for `tokens` tokens, and the block row."""
    pages = -(-tokens // PAGE_SIZE)
    pool = CachePool.for_model(model, 1 + pages, block_size=PAGE_SIZE)
    return pool, torch.arange(pages, dtype=torch.int32) + 1


def reference_prefill(model: K3ForCausalLM, ids: list[int], room: int) -> tuple[torch.Tensor, CachePool, torch.Tensor]:
    """The unsharded prefill (one call): (every position's logits [T, V], pool, block row)."""
    pool, row = new_cache(model, room)
    meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[STATE_ROW], block_table=row[None],
                                 page_size=PAGE_SIZE, all_logits=True)
    return model(meta, pool.views).logits, pool, row


def cache_snapshot(model: K3ForCausalLM, pool: CachePool, tokens: int) -> dict[str, list[torch.Tensor]]:
    """The prompt's cache contents: KDA recurrent / conv rows, latent rows and index keys
    (values as float, scales) of positions [0, tokens)."""
    views, row = pool.views, torch.arange(tokens)
    page, off = 1 + row // PAGE_SIZE, row % PAGE_SIZE
    snap = {"recurrent": [v.recurrent[STATE_ROW].clone() for v in views.kda],
            "conv": [v.conv[STATE_ROW].clone() for v in views.kda],
            "latent": [v.pages[page, off].double() for v in views.latent]}
    if views.index_keys is not None:
        snap["key_values"] = [v.values[page, off].double() for v in views.index_keys]
        snap["key_scales"] = [v.scales[page, off].clone() for v in views.index_keys]
    return snap


def greedy_decode(model: K3ForCausalLM, pool: CachePool, row: torch.Tensor, length: int, first: torch.Tensor,
                  steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy decode steps on one rank after a prefill of `length` tokens whose last
    logits are `first`: (tokens, each step's logits)."""
    tokens, logits, nxt = [], [], int(first.argmax())
    for i in range(steps):
        tokens.append(nxt)
        meta = ForwardMetadata.build([[nxt]], context_lens=[length + i], state_indices=[STATE_ROW],
                                     block_table=row[None], page_size=PAGE_SIZE)
        out = model(meta, pool.views).logits[0]
        logits.append(out)
        nxt = int(out.argmax())
    return tokens, logits


def main(rank: int, init: str, out: str, jobs: list[dict]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}          # every rank creates every group
    results, models = {}, {}
    for index, job in enumerate(jobs):
        if rank >= job["world"]:
            continue
        key = (job["checkpoint"], job["world"] if job["tp"] else 1)
        if key not in models:
            parallel = ParallelContext.from_torch_distributed(groups[job["world"]]) if job["tp"] else None
            models[key] = load_model(job["checkpoint"], dtype=torch.float64, progress=False, parallel=parallel)
        model = models[key]
        ids = prompt(job["length"], model.cfg.vocab_size, job["seed"])
        pool, row = new_cache(model, job["length"] + job["decode"])
        runner = TokenShardedPrefill(model, rank=rank, world=job["world"],
                                     collectives=TorchDistributedCollectives(groups[job["world"]]))
        res = runner.prefill(ids, pool.views, block_row=row, state_row=STATE_ROW, page_size=PAGE_SIZE,
                             all_logits=job["all_logits"])
        results[index] = {"logits": res.logits, "bytes": res.bytes_gathered,
                          "cache": cache_snapshot(model, pool, job["length"])}
        if (rank == 0 or job["tp"]) and job["decode"]:
            results[index]["tokens"], results[index]["decode_logits"] = greedy_decode(
                model, pool, row, job["length"], res.logits[-1], job["decode"])
    torch.save(results, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()))
