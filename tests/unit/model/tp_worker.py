"""One tensor-parallel rank for test_tensor_parallel.py: python tp_worker.py RANK WORLD INIT OUT CKPT..."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from model_runs import teacher_forced  # noqa: E402

from k3.checkpoint.loader import load_model  # noqa: E402
from k3.model import ParallelContext  # noqa: E402


def main(rank: int, world: int, init_file: str, out: str, checkpoints: list[str], prompts: list[list[int]]):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel = ParallelContext.from_torch_distributed()
    results = {}
    for path in checkpoints:
        model = load_model(path, dtype=torch.float64, parallel=parallel, progress=False)
        results[path] = teacher_forced(model, prompts, chunk=6)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    prompts = [[int(x) for x in p.split(",")] for p in sys.argv[5].split(";")]
    main(rank, world, init_file, out, sys.argv[6:], prompts)
