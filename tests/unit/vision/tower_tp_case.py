"""The tower and images test_tower_tensor_parallel.py and its worker share (float64, random)."""

import torch

from k3.vision import MoonViTConfig, MoonViTTower, init_vision_params

# 4 heads (a TP = 2 shard holds 2), qkv width != hidden, an MLP width that splits evenly
CONFIG = {"model_type": "moonvit", "patch_size": 4, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
          "vt_num_attention_heads": 4, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
          "vt_intermediate_size": 24, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2],
          "text_hidden_size": 20, "norm_type": "rmsnorm", "mm_projector_type": "patchmergerv2"}
GRIDS = [(6, 6), (4, 8), (2, 2)]            # three images: data mode gives rank 0 two, rank 1 one


def tower() -> MoonViTTower:
    """A fresh whole tower (its norms perturbed away from 1 so a misplaced norm shows)."""
    cfg = MoonViTConfig.from_dict(CONFIG)
    params = init_vision_params(cfg, seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    params = {n: (t + 0.1 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if "norm" in n else t)
              for n, t in params.items()}
    return MoonViTTower(cfg, params)


def images() -> torch.Tensor:
    """The patches of GRIDS' images, packed: [sum(h*w), 3, 4, 4]."""
    n = sum(h * w for h, w in GRIDS)
    return torch.randn(n, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
