"""One TP rank for test_tower_tensor_parallel.py: python tower_tp_worker.py RANK WORLD INIT OUT.

Encodes the test's images in both mm_encoder_tp_modes through k3.engine.distributed.tp.tp_encode
(float64, gloo) and saves {mode: [output per image]} as OUT.RANK.pt."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from tower_tp_case import GRIDS, images, tower  # noqa: E402

from k3.engine.distributed.tp import tp_encode  # noqa: E402
from k3.model.parallel import TorchDistributedCollectives  # noqa: E402
from k3.vision.tensor_parallel import shard_tower  # noqa: E402


def main(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    patches = images()
    results = {}
    for mode in ("weights", "data"):
        t = tower()
        if mode == "weights":
            shard_tower(t, rank, world, TorchDistributedCollectives().all_reduce)
        results[mode] = tp_encode(t, patches, GRIDS, None, world, rank, mode)
    torch.save(results, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
