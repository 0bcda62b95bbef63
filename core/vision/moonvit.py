"""MoonViT vision tower + `patchmergerv2` projector of the K3 checkpoint, as plain torch reference ops.

Contract: `MoonViTTower(config, params).encode(patches, grid_hws)` takes the normalised pixel patches of
one or more images (`[sum(h*w), 3, patch, patch]`, row-major within each image, images concatenated) and
their patch grids `[(h, w), ...]` (h, w even multiples of the merge kernel), and returns one tensor per
image of `[(h/kh)*(w/kw), text_hidden_size]` embeddings: what the language model's media placeholders take.

Math (published K3 vision config: rmsnorm, no biases, qkv_hidden_size != hidden_size, tanh-GELU MLP,
bilinear-interpolated learnable 2D position table, 2D rotary embedding, 2x2 spatial patch merge):
  x = conv_patch(patches) + interp(pos_emb, (h, w))
  per block: x += wo(attn(rope2d(wqkv(norm0(x))))) ; x += fc1(gelu_tanh(fc0(norm1(x))))
  x = final_layernorm(x) ; merge 2x2 neighbours -> [N/4, 4*D]
  out = post_norm(linear_2(gelu(linear_1(x))))
Attention is full (bidirectional) within one image and never across images. The rotary embedding rotates
adjacent channel pairs (non-neox): pair 2j by column*f_j, pair 2j+1 by row*f_j, f_j = 1/10000^(4j/head_dim).

Parameters are keyed by their checkpoint names (`vision_tower.*`, `mm_projector.*`), the names the
released checkpoint and vLLM's loader use (vLLM renames `mm_projector.proj.0/2` to `linear_1/2`).
Images only (temporal size 1); video frames are not served.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

ROPE_MAX_SIDE = 512  # the rotary table covers grids up to 512 x 512 patches


@dataclass(frozen=True)
class MoonViTConfig:
    """The `vision_config` fields the tower reads (published names; `vt_*` and the aliases both accepted)."""
    patch_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    qkv_hidden_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel: tuple[int, int]
    text_hidden_size: int
    projector_ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, vc: Mapping[str, Any]) -> "MoonViTConfig":
        def pick(*names: str, default: Any = None) -> Any:
            for n in names:
                if vc.get(n) is not None:
                    return vc[n]
            if default is None:
                raise ValueError(f"vision_config lacks {names[0]!r}")
            return default
        for field, want in (("norm_type", "rmsnorm"), ("mm_projector_type", "patchmergerv2"),
                            ("merge_type", "sd2_tpool"), ("pos_emb_interpolation_mode", "bilinear")):
            if vc.get(field, want) != want:
                raise ValueError(f"vision_config {field}={vc[field]!r}: only {want!r} (the K3 tower) is built")
        for field in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            if vc.get(field):
                raise ValueError(f"vision_config {field}=True: the K3 tower has no biases")
        hidden = int(pick("vt_hidden_size", "hidden_size"))
        cfg = cls(patch_size=int(pick("patch_size")), hidden_size=hidden,
                  num_layers=int(pick("vt_num_hidden_layers", "num_hidden_layers")),
                  num_heads=int(pick("vt_num_attention_heads", "num_attention_heads")),
                  intermediate_size=int(pick("vt_intermediate_size", "intermediate_size")),
                  qkv_hidden_size=int(pick("qkv_hidden_size", default=hidden)),
                  pos_emb_height=int(pick("init_pos_emb_height", "pos_emb_height")),
                  pos_emb_width=int(pick("init_pos_emb_width", "pos_emb_width")),
                  merge_kernel=tuple(int(k) for k in pick("merge_kernel_size", default=[2, 2])),
                  text_hidden_size=int(pick("text_hidden_size")),
                  projector_ln_eps=float(pick("projector_ln_eps", default=1e-5)))
        if cfg.qkv_hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"vision_config: qkv_hidden_size {cfg.qkv_hidden_size} / {cfg.num_heads} heads "
                             "must give a head dim divisible by 4 (2D rotary)")
        return cfg


def vision_param_shapes(cfg: MoonViTConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tower and projector tensor."""
    d, p, merged = cfg.hidden_size, cfg.patch_size, cfg.hidden_size * cfg.merge_kernel[0] * cfg.merge_kernel[1]
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (cfg.pos_emb_height, cfg.pos_emb_width, d),
    }
    for i in range(cfg.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes.update({b + "norm0.weight": (d,), b + "norm1.weight": (d,),
                       b + "wqkv.weight": (3 * cfg.qkv_hidden_size, d), b + "wo.weight": (d, cfg.qkv_hidden_size),
                       b + "mlp.fc0.weight": (cfg.intermediate_size, d),
                       b + "mlp.fc1.weight": (d, cfg.intermediate_size)})
    shapes.update({"vision_tower.encoder.final_layernorm.weight": (d,),
                   "mm_projector.proj.0.weight": (merged, merged),
                   "mm_projector.proj.2.weight": (cfg.text_hidden_size, merged),
                   "mm_projector.post_norm.weight": (cfg.text_hidden_size,)})
    return shapes


def init_vision_params(cfg: MoonViTConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
                       ) -> dict[str, torch.Tensor]:
    """Random weights for `k3 checkpoint init`: norms at 1, matrices N(0, 1/fan_in), position table N(0, 0.02).

    Uses its own generator so drawing the tower never perturbs the text weights' random stream."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in vision_param_shapes(cfg).items():
        if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
            t = torch.ones(shape, dtype=torch.float64)
        elif name.endswith("pos_emb.weight"):
            t = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.02
        else:
            fan_in = math.prod(shape[1:])
            t = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        out[name] = t.to(dtype)
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """torch.nn.RMSNorm semantics (eps None = the dtype's machine epsilon, as the tower's norms use)."""
    e = torch.finfo(x.dtype).eps if eps is None else eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * weight


def rope_2d_angles(h: int, w: int, head_dim: int, *, dtype: torch.dtype,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """[h*w, head_dim/2] rotation angles: pair 2j rotates by col*f_j, pair 2j+1 by row*f_j.

    The angles are computed in float32 whatever `dtype` is (the tower's rotary table is complex64 in
    the released code and in vLLM), then cast; cos/sin are taken in `dtype`."""
    if not (1 <= h <= ROPE_MAX_SIDE and 1 <= w <= ROPE_MAX_SIDE):
        raise ValueError(f"image patch grid {h}x{w} exceeds the rotary table ({ROPE_MAX_SIDE} per side)")
    f32 = dict(dtype=torch.float32, device=device)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 4, **f32)[: head_dim // 4] / head_dim))
    rows = torch.arange(h, **f32).repeat_interleave(w)
    cols = torch.arange(w, **f32).repeat(h)
    ang = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1)  # [hw, hd/4, 2]
    return ang.reshape(h * w, head_dim // 2).to(dtype)


def _apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x [n, heads, head_dim] by angles [n, head_dim/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class MoonViTTower:
    """The tower + projector over a parameter dict keyed by checkpoint names (see module docstring)."""

    def __init__(self, cfg: MoonViTConfig, params: Mapping[str, torch.Tensor]):
        missing = [n for n in vision_param_shapes(cfg) if n not in params]
        if missing:
            raise ValueError(f"vision weights missing {len(missing)} tensors, e.g. {missing[0]!r}")
        for name, shape in vision_param_shapes(cfg).items():
            if tuple(params[name].shape) != shape:
                raise ValueError(f"vision weight {name!r} has shape {tuple(params[name].shape)}, expected {shape}")
        self.cfg, self.p = cfg, dict(params)
        self._pos_cache: dict[tuple, torch.Tensor] = {}
        # tensor parallelism (k3.vision.tensor_parallel.shard_tower): the attention heads this
        # process holds, and the sum over the TP ranks of a block's partial outputs (None: whole)
        self.local_heads = cfg.num_heads
        self.reduce = None

    def tokens_for_grid(self, h: int, w: int) -> int:
        """Placeholder tokens one image of h x w patches takes in the text stream."""
        kh, kw = self.cfg.merge_kernel
        return (h // kh) * (w // kw)

    def _pos_embed(self, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        """[h*w, hidden] position embeddings: the table, bilinearly resized to the grid (memoised per
        grid and dtype: the table never changes, and the resize is a slow kernel on accelerators)."""
        key = (h, w, dtype)
        if key not in self._pos_cache:
            if len(self._pos_cache) >= 64:      # bounded: many distinct image sizes must not grow it
                self._pos_cache.clear()
            table = self.p["vision_tower.patch_embed.pos_emb.weight"]
            if (h, w) == tuple(table.shape[:2]):
                self._pos_cache[key] = table.reshape(h * w, -1).to(dtype)
            else:
                grid = F.interpolate(table.to(dtype).permute(2, 0, 1)[None], size=(h, w), mode="bilinear")
                self._pos_cache[key] = grid[0].permute(1, 2, 0).reshape(h * w, -1)
        return self._pos_cache[key]

    def _block(self, x: torch.Tensor, i: int, angles: torch.Tensor) -> torch.Tensor:
        c, p, b = self.cfg, self.p, f"vision_tower.encoder.blocks.{i}."
        y = _rms_norm(x, p[b + "norm0.weight"].to(x.dtype), None)
        q, k, v = (y @ p[b + "wqkv.weight"].to(x.dtype).T).unflatten(-1, (3, self.local_heads, c.head_dim)).unbind(-3)
        q, k = _apply_rope(q, angles), _apply_rope(k, angles)
        # [1, heads, n, head_dim]: with a batch dimension SDPA can take its fused backends (a 3-D call
        # falls back to the math path, which runs in float32 on CUDA)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, scale=c.head_dim ** -0.5)[0]
        x = x + self._sum(attn.transpose(0, 1).reshape(x.shape[0], -1) @ p[b + "wo.weight"].to(x.dtype).T)
        y = _rms_norm(x, p[b + "norm1.weight"].to(x.dtype), None)
        y = F.gelu(y @ p[b + "mlp.fc0.weight"].to(x.dtype).T, approximate="tanh")
        return x + self._sum(y @ p[b + "mlp.fc1.weight"].to(x.dtype).T)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: this rank's partial sum, summed over the TP ranks."""
        return partial if self.reduce is None else self.reduce(partial)

    def encode_one(self, patches: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """One image: patches [h*w, 3, P, P] -> embeddings [tokens_for_grid(h, w), text_hidden_size]."""
        c, p = self.cfg, self.p
        kh, kw = c.merge_kernel
        if h % kh or w % kw:
            raise ValueError(f"image patch grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        if patches.shape[0] != h * w:
            raise ValueError(f"{patches.shape[0]} patches for a {h}x{w} grid")
        dt = patches.dtype
        proj = p["vision_tower.patch_embed.proj.weight"].to(dt)
        x = patches.flatten(1) @ proj.flatten(1).T + self._pos_embed(h, w, dt)
        angles = rope_2d_angles(h, w, c.head_dim, dtype=dt, device=patches.device)
        for i in range(c.num_layers):
            x = self._block(x, i, angles)
        x = _rms_norm(x, p["vision_tower.encoder.final_layernorm.weight"].to(dt), None)
        x = x.reshape(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1)
        x = F.gelu(x @ p["mm_projector.proj.0.weight"].to(dt).T)
        x = x @ p["mm_projector.proj.2.weight"].to(dt).T
        return _rms_norm(x, p["mm_projector.post_norm.weight"].to(dt), c.projector_ln_eps)

    def encode(self, patches: torch.Tensor, grid_hws: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Several images packed along dim 0 (never attending across each other) -> one tensor per image."""
        sizes = [h * w for h, w in grid_hws]
        if sum(sizes) != patches.shape[0]:
            raise ValueError(f"{patches.shape[0]} patches for grids totalling {sum(sizes)}")
        return [self.encode_one(chunk, h, w) for chunk, (h, w) in zip(patches.split(sizes), grid_hws)]
