"""The vision tower under tensor parallelism: vLLM's two `mm_encoder_tp_mode`s.

- "weights" (vLLM's default): each block's attention is split by heads and its MLP by columns,
  as vLLM's MoonViT builds it (`wqkv` a QKVParallelLinear, `wo` and `mlp.fc1` RowParallelLinear
  with a sum over the ranks, `mlp.fc0` a ColumnParallelLinear); the patch embedding, position
  table, norms and the projector are replicated. Every rank runs every image through its shard
  and ends with the whole output. `shard_tower` turns a whole tower into rank r's shard.
- "data": every rank holds the whole tower and encodes its share of the step's images; the
  outputs are all-gathered (`k3.engine.distributed.tp.encode_share`).

vLLM falls back to "data" when the heads do not divide by the TP size (`encoder_tp_mode` does
the same, and also when the MLP width does not).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3.log import get_logger

from .moonvit import MoonViTConfig, MoonViTTower

logger = get_logger(__name__)

def encoder_tp_mode(requested: str, cfg: MoonViTConfig, tp_size: int) -> str:
    """The mode the encoder runs in: `requested`, or "data" (with a warning) when "weights" cannot
    split this tower `tp_size` ways (`requested` is checked by EngineConfig.validate)."""
    if requested == "weights" and tp_size > 1:
        uneven = [f"{name} {n}" for name, n in (("attention heads", cfg.num_heads),
                                                ("MLP width", cfg.intermediate_size)) if n % tp_size]
        if uneven:
            logger.warning(f"the vision tower's {' and '.join(uneven)} do not divide by the tensor-parallel size "
                           f"{tp_size}: its encoder runs data-parallel (mm_encoder_tp_mode data), as vLLM does")
            return "data"
    return requested


def shard_tower(tower: MoonViTTower, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make `tower` rank `rank`'s shard of `size` in place ("weights" mode): the block matrices
    sliced by heads (wqkv rows, wo columns) and MLP columns (fc0 rows, fc1 columns), and the
    row-parallel outputs summed by `all_reduce` (the TP group's sum). The heads and the MLP width
    must divide by `size` (`encoder_tp_mode`)."""
    c = tower.cfg
    if c.num_heads % size or c.intermediate_size % size:
        raise ValueError(f"a tower with {c.num_heads} heads and MLP width {c.intermediate_size} cannot be split "
                         f"{size} ways by weights")
    heads, cols = c.num_heads // size, c.intermediate_size // size
    h0, f0 = rank * heads, rank * cols
    for i in range(c.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        wqkv = tower.p[b + "wqkv.weight"]                       # [3 * heads * head_dim, d], rows (q|k|v, head, j)
        tower.p[b + "wqkv.weight"] = (wqkv.view(3, c.num_heads, c.head_dim, -1)[:, h0: h0 + heads]
                                      .reshape(3 * heads * c.head_dim, -1).clone())
        tower.p[b + "wo.weight"] = tower.p[b + "wo.weight"][:, h0 * c.head_dim: (h0 + heads) * c.head_dim].clone()
        tower.p[b + "mlp.fc0.weight"] = tower.p[b + "mlp.fc0.weight"][f0: f0 + cols].clone()
        tower.p[b + "mlp.fc1.weight"] = tower.p[b + "mlp.fc1.weight"][:, f0: f0 + cols].clone()
    tower.local_heads = heads
    tower.reduce = all_reduce if size > 1 else None
