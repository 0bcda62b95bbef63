"""Image -> MoonViT patches, the navit rule K3's image processor (and vLLM's `kimi_k3` preprocessing) uses.

`plan_resize(width, height, ...)` picks the resized size and bottom/right padding: the image is scaled
down (never up) so that it holds at most `in_patch_limit` patches and at most `patch_limit_on_one_side`
patches per side, then padded to a multiple of merge_kernel * patch_size. The placeholder count is the
merged grid (padded_h / factor) * (padded_w / factor).

`image_to_patches(pixels, ...)` applies the plan to a decoded float image [3, H, W] in [0, 1]
(resize bicubic, normalise with the processor's mean/std, zero-pad) and returns the patches
[h*w, 3, P, P] row-major with their grid (h, w), as `MoonViTTower.encode` takes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ResizePlan:
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    num_tokens: int


def plan_resize(width: int, height: int, *, patch_size: int, merge_kernel: int, in_patch_limit: int,
                patch_limit_on_one_side: int) -> ResizePlan:
    """The navit resize plan for one image of width x height pixels (see module docstring)."""
    if width < 1 or height < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    cap = patch_limit_on_one_side * patch_size
    by_count = math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    scale = min(1.0, by_count, cap / width, cap / height)
    new_w = min(max(1, int(width * scale)), cap)
    new_h = min(max(1, int(height * scale)), cap)
    factor = merge_kernel * patch_size
    pad_w, pad_h = (-new_w) % factor, (-new_h) % factor
    tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
    return ResizePlan(new_w, new_h, pad_w, pad_h, tokens)


def image_to_patches(pixels: torch.Tensor, *, patch_size: int, merge_kernel: int, in_patch_limit: int,
                     patch_limit_on_one_side: int, mean: Sequence[float] = (0.5, 0.5, 0.5),
                     std: Sequence[float] = (0.5, 0.5, 0.5)) -> tuple[torch.Tensor, tuple[int, int]]:
    """Decoded image [3, H, W] (float, 0..1) -> (patches [h*w, 3, P, P], grid (h, w))."""
    if pixels.ndim != 3 or pixels.shape[0] != 3:
        raise ValueError(f"expected an RGB image [3, H, W], got shape {tuple(pixels.shape)}")
    plan = plan_resize(pixels.shape[2], pixels.shape[1], patch_size=patch_size, merge_kernel=merge_kernel,
                       in_patch_limit=in_patch_limit, patch_limit_on_one_side=patch_limit_on_one_side)
    x = pixels.to(torch.float32)
    if (plan.new_height, plan.new_width) != tuple(x.shape[1:]):
        x = F.interpolate(x[None], size=(plan.new_height, plan.new_width), mode="bicubic",
                          align_corners=False)[0].clamp(0.0, 1.0)
    m = torch.tensor(mean, dtype=x.dtype)[:, None, None]
    s = torch.tensor(std, dtype=x.dtype)[:, None, None]
    x = F.pad((x - m) / s, (0, plan.pad_width, 0, plan.pad_height))
    h, w = x.shape[1] // patch_size, x.shape[2] // patch_size
    patches = x.reshape(3, h, patch_size, w, patch_size).permute(1, 3, 0, 2, 4).reshape(h * w, 3, patch_size,
                                                                                        patch_size)
    return patches, (h, w)
