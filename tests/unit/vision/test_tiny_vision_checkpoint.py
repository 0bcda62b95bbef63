"""`k3 checkpoint init --preset k3-tiny` (= k3-tiny-vision): k3-tiny-text's tensors unchanged, plus a loadable tower."""
import torch
from safetensors import safe_open

from k3.checkpoint.loader import shard_files
from k3.cli.checkpoint import init_checkpoint
from k3.vision.preprocess import image_to_patches
from k3.vision.weights import load_vision_tower


def _tensors(d):
    out = {}
    for path in shard_files(d):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_tiny_vision_checkpoint_keeps_text_weights_and_serves_a_tower(tmp_path):
    text_only = _tensors(init_checkpoint("k3-tiny-text", tmp_path / "t", progress=False))
    with_tower = _tensors(init_checkpoint("k3-tiny", tmp_path / "v", progress=False))
    vision = {n for n in with_tower if n.startswith(("vision_tower.", "mm_projector."))}
    assert vision and set(with_tower) - vision == set(text_only)
    assert all(torch.equal(with_tower[n], t) for n, t in text_only.items())
    tower = load_vision_tower(tmp_path / "v")
    assert load_vision_tower(tmp_path / "t") is None
    img = torch.rand(3, 40, 70, generator=torch.Generator().manual_seed(0))
    patches, (h, w) = image_to_patches(img, patch_size=14, merge_kernel=2, in_patch_limit=4096,
                                       patch_limit_on_one_side=64)
    (emb,) = tower.encode(patches, [(h, w)])
    assert (h, w) == (4, 6) and emb.shape == (tower.tokens_for_grid(h, w), 64) and torch.isfinite(emb).all()
