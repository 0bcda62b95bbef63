"""MoonViT tower + projector (core/vision): float64 equality against an independent formulation, packing
isolation, checkpoint names/shapes, and the navit resize plan's worked examples."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3.vision import MoonViTConfig, MoonViTTower, init_vision_params, vision_param_shapes
from k3.vision.preprocess import image_to_patches, plan_resize

TINY = {"model_type": "moonvit", "patch_size": 4, "init_pos_emb_height": 6, "init_pos_emb_width": 6,
        "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
        "vt_intermediate_size": 24, "qkv_hidden_size": 24, "merge_kernel_size": [2, 2],
        "text_hidden_size": 20, "norm_type": "rmsnorm", "mm_projector_type": "patchmergerv2"}


def _independent(p, cfg, patches, h, w):
    """Same math written differently: conv2d patch embed, complex rotary, explicit softmax, gather merge."""
    d = torch.float64
    eps = torch.finfo(d).eps

    def rms(x, wt, e=eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + e) * wt

    x = F.conv2d(patches, p["vision_tower.patch_embed.proj.weight"], stride=cfg.patch_size).flatten(1)
    table = p["vision_tower.patch_embed.pos_emb.weight"]
    x = x + F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")[0].flatten(1).T
    hd = cfg.head_dim
    # angles in float32 by contract (the tower's rotary table is complex64, as in vLLM), then widened
    f = 1.0 / (10000.0 ** (4 * torch.arange(hd // 4, dtype=torch.float32) / hd))
    rows = torch.tensor([r for r in range(h) for _ in range(w)], dtype=torch.float32)
    cols = torch.tensor([c for _ in range(h) for c in range(w)], dtype=torch.float32)
    ang = torch.empty(h * w, hd // 2, dtype=torch.float32)
    ang[:, 0::2] = cols[:, None] * f
    ang[:, 1::2] = rows[:, None] * f
    ang = ang.to(d)
    cis = torch.polar(torch.ones_like(ang), ang)[:, None, :]

    def rot(t):
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * cis).flatten(-2)

    for i in range(cfg.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        y = rms(x, p[b + "norm0.weight"]) @ p[b + "wqkv.weight"].T
        q, k, v = y.split(cfg.qkv_hidden_size, dim=-1)
        q, k, v = (t.reshape(h * w, cfg.num_heads, hd) for t in (q, k, v))
        q, k = rot(q), rot(k)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(h * w, -1)
        x = x + o @ p[b + "wo.weight"].T
        y = rms(x, p[b + "norm1.weight"]) @ p[b + "mlp.fc0.weight"].T
        y = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
        x = x + y @ p[b + "mlp.fc1.weight"].T
    x = rms(x, p["vision_tower.encoder.final_layernorm.weight"])
    idx = torch.arange(h * w).reshape(h // 2, 2, w // 2, 2).permute(0, 2, 1, 3).reshape(-1, 4)
    x = x[idx].flatten(1)
    x = x @ p["mm_projector.proj.0.weight"].T
    x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    x = x @ p["mm_projector.proj.2.weight"].T
    return rms(x, p["mm_projector.post_norm.weight"], cfg.projector_ln_eps)


@pytest.fixture(scope="module")
def tower():
    cfg = MoonViTConfig.from_dict(TINY)
    params = init_vision_params(cfg, seed=3, dtype=torch.float64)
    params = {n: (t + 0.1 * torch.randn_like(t) if "norm" in n else t) for n, t in params.items()}
    return cfg, params, MoonViTTower(cfg, params)


@pytest.mark.parametrize("h,w", [(6, 6), (4, 8), (2, 10)])  # table size exact, and interpolated
def test_tower_matches_independent_float64(tower, h, w):
    cfg, params, model = tower
    patches = torch.randn(h * w, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(h * w))
    got = model.encode_one(patches, h, w)
    want = _independent(params, cfg, patches, h, w)
    assert got.shape == (model.tokens_for_grid(h, w), 20)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_packed_images_do_not_attend_across(tower):
    _, _, model = tower
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(16, 3, 4, 4, dtype=torch.float64, generator=g), torch.randn(8, 3, 4, 4, dtype=torch.float64, generator=g)
    packed = model.encode(torch.cat([a, b]), [(4, 4), (2, 4)])
    torch.testing.assert_close(packed[0], model.encode_one(a, 4, 4), rtol=0, atol=0)
    torch.testing.assert_close(packed[1], model.encode_one(b, 2, 4), rtol=0, atol=0)
    flipped = model.encode_one(a.flip(0), 4, 4)  # positions matter: a transposed image is a different input
    assert not torch.allclose(flipped, packed[0])


def test_checkpoint_names_and_shape_errors(tower):
    cfg, params, _ = tower
    shapes = vision_param_shapes(cfg)
    assert shapes["vision_tower.encoder.blocks.1.wqkv.weight"] == (72, 16)
    assert shapes["mm_projector.proj.0.weight"] == (64, 64) and shapes["mm_projector.proj.2.weight"] == (20, 64)
    assert all(n.startswith(("vision_tower.", "mm_projector.")) for n in shapes)
    bad = dict(params)
    bad["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="blocks.0.wo.weight"):
        MoonViTTower(cfg, bad)
    with pytest.raises(ValueError, match="norm_type"):
        MoonViTConfig.from_dict({**TINY, "norm_type": "layernorm"})
    _, _, model = tower
    with pytest.raises(ValueError, match="merge kernel"):
        model.encode_one(torch.zeros(15, 3, 4, 4, dtype=torch.float64), 3, 5)


def test_navit_resize_worked_examples():
    kw = dict(patch_size=14, merge_kernel=2, in_patch_limit=16384, patch_limit_on_one_side=512)
    small = plan_resize(100, 50, **kw)  # never upscaled; padded to multiples of 28
    assert (small.new_width, small.new_height, small.pad_width, small.pad_height) == (100, 50, 12, 6)
    assert small.num_tokens == (112 // 28) * (56 // 28) == 8
    big = plan_resize(4000, 3000, patch_size=14, merge_kernel=2, in_patch_limit=1024, patch_limit_on_one_side=512)
    # sqrt(1024 / (285 * 214)) = 0.12958: 4000 -> 518, 3000 -> 388; padded to 532 x 392
    assert (big.new_width, big.new_height, big.pad_width, big.pad_height) == (518, 388, 14, 4)
    assert big.num_tokens == 19 * 14
    with pytest.raises(ValueError, match="no pixels"):
        plan_resize(0, 10, **kw)


def test_image_to_patches_layout():
    img = torch.rand(3, 8, 16, generator=torch.Generator().manual_seed(1))
    patches, grid = image_to_patches(img, patch_size=4, merge_kernel=2, in_patch_limit=1000,
                                     patch_limit_on_one_side=100)
    assert grid == (2, 4) and patches.shape == (8, 3, 4, 4)
    torch.testing.assert_close(patches[5], (img[:, 4:8, 4:8] - 0.5) / 0.5)  # row 1, column 1
    with pytest.raises(ValueError, match="RGB"):
        image_to_patches(torch.rand(8, 8), patch_size=4, merge_kernel=2, in_patch_limit=10, patch_limit_on_one_side=10)


def test_load_vision_tower_from_checkpoint_dir(tmp_path, tower):
    import json

    from safetensors.torch import save_file

    from k3.checkpoint.loader import CheckpointError
    from k3.vision.weights import load_vision_tower
    cfg, params, model = tower
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "vision_config": TINY}))
    save_file({n: t.contiguous() for n, t in params.items()} | {"language_model.norm.weight": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    loaded = load_vision_tower(tmp_path, dtype=torch.float64)
    x = torch.randn(16, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(loaded.encode_one(x, 4, 4), model.encode_one(x, 4, 4), rtol=0, atol=0)
    partial = {n: t for n, t in params.items() if "blocks.1." not in n}
    save_file(partial, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="blocks.1"):
        load_vision_tower(tmp_path)


def test_the_tower_builds_everything_on_the_patches_device(tower):
    """Weights and patches on another device (meta here, standing in for an accelerator): every
    table the tower builds per call (rotary angles, positions) must follow, or CUDA fails mixing
    host and device tensors."""
    cfg, params, _ = tower
    model = MoonViTTower(cfg, {n: t.to("meta") for n, t in params.items()})
    out = model.encode_one(torch.empty(4 * 8, 3, 4, 4, dtype=torch.float64, device="meta"), 4, 8)
    assert out.device.type == "meta" and out.shape == (model.tokens_for_grid(4, 8), 20)
