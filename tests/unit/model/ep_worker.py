"""One of the 4 ranks of test_expert_parallel.py (gloo, file rendezvous, float64):

    python ep_worker.py RANK INIT_FILE OUT JOBS_JSON

JOBS_JSON: a list of {"scenario", "mode", "checkpoint", "chunk", "trim"}; each job builds the
scenario's groups' model for this rank and runs its prompts teacher-forced, `chunk` tokens per
sequence per call, the way a data-parallel runtime keeps EP ranks in lockstep: the number of
forward calls and the static capacity are all-reduced (max) over the EP group, and a rank
with fewer calls (or an idle one, with none) fills them with `idle_forward`.
Writes OUT.RANK.pt: {job index: {"logits": [per prompt], "experts": (first, count) held}}
(idle ranks: no entry).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from model_runs import teacher_forced  # noqa: E402

from k3.checkpoint.loader import load_model  # noqa: E402
from k3.model import ParallelContext  # noqa: E402

WORLD = 4
# name: (TP groups, EP groups, whose prompts each rank runs, idle ranks); groups are None (no
# TP / no EP), "pairs" ({0, 1} and {2, 3}) or "world"
SCENARIOS = {
    "ep4": (None, "world", (0, 1, 2, 3), ()),
    "ep4_idle": (None, "world", (0, 1, 2, 3), (3,)),
    "ep2": (None, "pairs", (0, 1, 2, 3), ()),
    "tp2_ep2": ("pairs", "pairs", (0, 0, 2, 2), ()),
    "dp2_tp2_ep4": ("pairs", "world", (0, 0, 2, 2), ()),
    "dp2_tp2_ep4_idle": ("pairs", "world", (0, 0, 2, 2), (2, 3)),
}
LENGTHS = ((21, 8), (19, 5), (23, 12), (20, 3))


def prompts(owner: int, trim: int | None = None) -> list[list[int]]:
    """Rank `owner`'s prompts (distinct per owner); trim: the first trim + owner tokens only."""
    out = [[(7 * i + 3 + 31 * owner + 5 * j) % 384 for i in range(n)] for j, n in enumerate(LENGTHS[owner])]
    return out if trim is None else [p[: trim + owner] for p in out]


def calls(ps: list[list[int]], chunk: int) -> int:
    """Forward calls teacher_forced makes for these prompts."""
    return -(-max(map(len, ps)) // chunk)


def main(rank: int, init: str, out: str, jobs: list[dict]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]        # every rank creates every group
    groups = {None: None, "world": dist.group.WORLD, "pairs": pairs[rank // 2]}
    results = {}
    for index, job in enumerate(jobs):
        tp, ep, owners, idle = SCENARIOS[job["scenario"]]
        ep_group = groups[ep]
        mine = [] if rank in idle else prompts(owners[rank], job["trim"])
        # what a runtime all-reduces per step: the forward calls and the most tokens of one call
        need = torch.tensor([calls(mine, job["chunk"]) if mine else 0,
                             sum(min(len(p), job["chunk"]) for p in mine)])
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=ep_group)
        steps, capacity = need.tolist()
        parallel = ParallelContext.from_groups(tp_group=groups[tp], ep_group=ep_group, dp_rank=rank // 2 if tp else rank,
                                               dp_size=2 if tp else WORLD, dispatch=job["mode"], capacity=capacity)
        model = load_model(job["checkpoint"], dtype=torch.float64, parallel=parallel, progress=False)
        if mine:
            moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
            results[index] = {"logits": teacher_forced(model, mine, chunk=job["chunk"]),
                              "experts": (moe.expert_start, moe.num_local_experts)}
        for _ in range(steps - (calls(mine, job["chunk"]) if mine else 0)):
            model.idle_forward()
    torch.save(results, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(Path(sys.argv[4]).read_text()))
