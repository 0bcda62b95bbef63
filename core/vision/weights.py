"""Loading the vision tower's tensors from a checkpoint directory by their checkpoint names.

The text loader (`k3.checkpoint.loader`) skips `vision_tower.*` / `mm_projector.*`; this module reads
exactly those tensors, checks every expected one is present with its shape, and builds the tower.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from k3.checkpoint.loader import CheckpointError, shard_files
from k3.checkpoint.shard_file import open_shard

from .moonvit import MoonViTConfig, MoonViTTower, vision_param_shapes

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def vision_config_of(top_config: Mapping[str, Any]) -> MoonViTConfig | None:
    """The tower config of a published nested config.json, or None for a text-only checkpoint."""
    vc = top_config.get("vision_config")
    return None if not vc else MoonViTConfig.from_dict(vc)


def has_vision_tensors(model_dir: str | Path) -> bool:
    """Whether any shard of the checkpoint holds a `vision_tower.*` / `mm_projector.*` tensor."""
    for path in shard_files(Path(model_dir)):
        with open_shard(path, CheckpointError) as f:
            if any(key.startswith(VISION_PREFIXES) for key in f.keys()):
                return True
    return False


def load_vision_tower(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> MoonViTTower | None:
    """The MoonViT tower of a checkpoint (None when its config has no vision_config).

    Raises CheckpointError naming the missing tensors when the config declares a tower the shards lack."""
    model_dir = Path(model_dir)
    cfg = vision_config_of(json.loads((model_dir / "config.json").read_text()))
    if cfg is None:
        return None
    want = vision_param_shapes(cfg)
    params: dict[str, torch.Tensor] = {}
    for path in shard_files(model_dir):
        with open_shard(path, CheckpointError) as f:
            for key in f.keys():
                if key.startswith(VISION_PREFIXES):
                    if key not in want:
                        raise CheckpointError(f"{path.name}: unexpected vision tensor {key!r}")
                    params[key] = f.get_tensor(key).to(dtype)
    missing = sorted(set(want) - set(params))
    if missing:
        raise CheckpointError(f"{model_dir}: config declares a vision tower but {len(missing)} of its tensors "
                              f"are missing, e.g. {missing[0]!r}")
    try:
        return MoonViTTower(cfg, params)
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
