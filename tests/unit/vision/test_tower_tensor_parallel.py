"""The vision tower under tensor parallelism (k3.vision.tensor_parallel, k3.engine.distributed.tp):
on two gloo processes in float64, "weights" (heads and MLP columns sharded, row-parallel sums)
and "data" (images split over the ranks, outputs all-gathered) give every rank the TP = 1
tower's embeddings of every image; a tower whose heads do not divide falls back to "data"."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tower_tp_case import GRIDS, images, tower  # noqa: E402

from k3.presets import K3_VISION_CONFIG  # noqa: E402
from k3.vision import MoonViTConfig  # noqa: E402
from k3.vision.tensor_parallel import encoder_tp_mode, shard_tower  # noqa: E402

WORKER = Path(__file__).with_name("tower_tp_worker.py")


def test_tp2_tower_equals_tp1_in_both_modes(tmp_path):
    want = tower().encode(images(), GRIDS)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", str(tmp_path / "rendezvous"),
                               str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}.pt")
        for mode in ("weights", "data"):
            assert len(got[mode]) == len(want)
            for a, b in zip(got[mode], want):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"rank {rank}, {mode}")


def test_shard_slices_heads_and_columns():
    """Rank 1 of 2 holds heads 2-3 of q, k and v, the matching wo columns and the second half of
    the MLP; the shards together are the whole matrices."""
    whole = tower()
    shards = [tower() for _ in range(2)]
    for r, t in enumerate(shards):
        shard_tower(t, r, 2, lambda x: x)
        assert t.local_heads == 2
    b = "vision_tower.encoder.blocks.1."
    hd = whole.cfg.head_dim
    qkv = whole.p[b + "wqkv.weight"].view(3, 4, hd, -1)
    torch.testing.assert_close(shards[1].p[b + "wqkv.weight"], qkv[:, 2:].reshape(3 * 2 * hd, -1), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.p[b + "wo.weight"] for s in shards], 1), whole.p[b + "wo.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.p[b + "mlp.fc0.weight"] for s in shards]), whole.p[b + "mlp.fc0.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s.p[b + "mlp.fc1.weight"] for s in shards], 1),
                               whole.p[b + "mlp.fc1.weight"], rtol=0, atol=0)


def test_weights_mode_falls_back_to_data_when_the_heads_do_not_divide():
    cfg = tower().cfg
    assert encoder_tp_mode("weights", cfg, 2) == "weights"
    assert encoder_tp_mode("weights", cfg, 3) == "data"             # 4 heads, 3 ranks
    assert encoder_tp_mode("data", cfg, 2) == "data"
    k3_tower = MoonViTConfig.from_dict({**K3_VISION_CONFIG, "text_hidden_size": 7168})    # 12 heads
    assert [encoder_tp_mode("weights", k3_tower, tp) for tp in (2, 4, 8)] == ["weights", "weights", "data"]
    with pytest.raises(ValueError, match="cannot be split 3 ways"):
        shard_tower(tower(), 0, 3, lambda x: x)
