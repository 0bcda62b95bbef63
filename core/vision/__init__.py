"""Native vision for K3 checkpoints: the MoonViT tower and its patch-merger projector (reference torch ops)."""
from .moonvit import MoonViTConfig, MoonViTTower, init_vision_params, vision_param_shapes

__all__ = ["MoonViTConfig", "MoonViTTower", "init_vision_params", "vision_param_shapes"]
