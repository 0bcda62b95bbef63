"""One of the 4 ranks of the DCP tests (gloo, file rendezvous):

    python dcp_worker.py RANK INIT_FILE OUT JOBS_JSON

JOBS_JSON: a list of jobs, each {"kind": "topk" | "model", "world": 2 or 4, ...}. A job with
world 2 runs on two groups at once ({0, 1} and {2, 3}); world 4 on all ranks.
  topk:  {"case": name}: the scores of `topk_case(name)` (the same on every rank), this rank's
         interleaved share through `distributed_topk`; result {"indices", "resent"}.
  packed: as topk, through `packed_topk` (one-word candidates); result {"mine", "resent", "ties",
         "wire", "round1"}.
  model: {"checkpoint", "chunk", "first", "prompts", "index_scale", "tp"}: the model with a DCP
         group of `world` inside a TP group of `tp` ranks (None: TP = 1), teacher-forced over the prompts (`chunk` tokens per call, then one);
         result {"logits": [per prompt], "resent": resend rows counted by the DCP record,
         "decode_resent": those of the one-token (decode) calls, "stored": latent rows this
         rank wrote}.
Writes OUT.RANK.pt: {job index: result}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from model_runs import teacher_forced  # noqa: E402

from k3.model.dcp_topk import distributed_topk, interleave, stack_gather  # noqa: E402
from k3.model.dcp_topk_packed import packed_topk, tie_worst_case_scores  # noqa: E402
from k3.model.parallel import ParallelContext, TorchDistributedCollectives  # noqa: E402

WORLD = 4


def topk_case(name: str) -> tuple[torch.Tensor, int, int]:
    """(scores [T, L] float64, topk, world) of a named case, the same on every process."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    world = 4 if name.endswith("4") else 2
    kind = name[:-2]
    scores = torch.randn(6, 97, generator=g, dtype=torch.float64)
    if kind == "ties":                       # few distinct values: ties at the cut-off
        scores = scores.mul(2).round()
    elif kind == "skewed":                   # rank 1 holds most of the top-k: forces the resend path
        scores[:, 1::world] += 5
    elif kind == "keyties":                  # near 1: many distinct scores share a bf16 key at the cut-off
        scores = 1 + scores * 1e-3
        scores[:, 5] = scores[:, 10] = scores.max() + 1e-4   # an exact tie across ranks: lower index first
    elif kind in ("allequal", "halfequal"):  # the tie worst case: every score at the cut-off is tied across ranks
        scores = tie_worst_case_scores(kind, 6, 97, 24, g)
    elif kind == "masked":                   # a causal-style mask: rows with fewer finite scores than topk
        scores[torch.arange(97)[None, :] > torch.tensor([3, 10, 20, 40, 60, 96])[:, None]] = float("-inf")
    return scores, 24, world


def launch(jobs: list[dict], work: Path, timeout: float = 300) -> list[dict]:
    """Run `jobs` on WORLD worker processes (one launch); returns every job's result per rank:
    [{job index: result} for each rank]. Raises with the workers' logs if one fails."""
    from rank_launch import run_ranks

    return run_ranks(__file__, jobs, work, WORLD, timeout)


def _dcp_group(world: int, rank: int, pairs):
    return dist.group.WORLD if world == WORLD else pairs[rank // 2]


def main(rank: int, init: str, out: str, jobs: list[dict]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]        # every rank creates every group
    results = {}
    for index, job in enumerate(jobs):
        group = _dcp_group(job["world"], rank, pairs)
        dcp_rank, world = dist.get_rank(group), dist.get_world_size(group)
        if job["kind"] == "topk":
            scores, topk, _ = topk_case(job["case"])
            gather = stack_gather(TorchDistributedCollectives(group).all_gather)
            res = distributed_topk(interleave(scores, world)[dcp_rank], topk=topk, rank=dcp_rank, world=world,
                                   all_gather=gather)
            results[index] = {"indices": res.indices, "resent": res.resent_rows}
            continue
        if job["kind"] == "packed":
            scores, topk, _ = topk_case(job["case"])
            gather = stack_gather(TorchDistributedCollectives(group).all_gather)
            res = packed_topk(interleave(scores, world)[dcp_rank], topk=topk, rank=dcp_rank, world=world,
                              all_gather=gather)
            results[index] = {"mine": res.mine, "resent": res.resent_rows, "ties": res.tie_rows,
                              "wire": res.wire_bytes, "round1": res.round1_bytes}
            continue
        from k3.checkpoint.loader import load_model

        tp = {None: None, 2: pairs[rank // 2], 4: dist.group.WORLD}[job.get("tp")]
        parallel = ParallelContext.from_groups(tp_group=tp, dcp_group=group)
        dcp = parallel.dcp
        model = load_model(job["checkpoint"], dtype=torch.float64, parallel=parallel, progress=False)
        scale_index_keys(model, job["index_scale"])
        calls: list[tuple[int, int]] = []           # per forward call: (tokens per sequence at most, resends so far)
        model.register_forward_hook(lambda m, args, out: calls.append((args[0].max_q_len, dcp.stats.resent_rows)))
        logits = teacher_forced(model, job["prompts"], chunk=job["chunk"], first=job.get("first"),
                                **job.get("cache", {}))
        decode_resent = sum(b - a for (_, a), (q, b) in zip([(0, 0)] + calls, calls) if q == 1)
        results[index] = {"logits": logits, "resent": dcp.stats.resent_rows, "decode_resent": decode_resent,
                          "stored": dcp.stats.stored_rows}
    torch.save(results, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def scale_index_keys(model, scale: float) -> None:
    """Multiply every DSA indexer's head weights by `scale` along the hidden size's even
    channels (a skew of the index scores toward some tokens; the same on every rank)."""
    if scale == 1:
        return
    for m in model.modules():
        if hasattr(m, "weights_proj"):
            m.weights_proj.data[:, ::2] *= scale


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()))
