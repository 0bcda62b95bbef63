"""k3-tiny-vision end to end below the engine: image -> tower -> placeholders -> K3 prefill logits."""
import pytest
import torch

from k3.cache.pool import CachePool
from k3.checkpoint.loader import load_model
from k3.cli.checkpoint import init_checkpoint
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata
from k3.vision.preprocess import image_to_patches
from k3.vision.prompt import expand_media_placeholders, stack_media_embeds
from k3.vision.weights import load_vision_tower


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    d = init_checkpoint("k3-tiny-vision", tmp_path_factory.mktemp("tv"), progress=False)
    return load_model(d, dtype=torch.float64, progress=False), load_vision_tower(d, dtype=torch.float64)


def _prefill_logits(model, tower, pixels):
    ph = model.cfg.media_placeholder_token_id
    patches, (h, w) = image_to_patches(pixels, patch_size=14, merge_kernel=2, in_patch_limit=4096,
                                       patch_limit_on_one_side=64)
    (emb,) = tower.encode(patches.to(torch.float64), [(h, w)])
    ids = expand_media_placeholders([5, 17, ph, 200, 3], [emb.shape[0]], ph)
    input_ids = torch.tensor(ids)
    cache = CachePool.for_model(model, 2, block_size=16).views
    blocks = (len(ids) + 15) // 16
    meta = ForwardMetadata.build([ids], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, blocks) + 1, page_size=16, all_logits=True)
    return model(meta, cache, media_embeds=stack_media_embeds([emb], input_ids, ph)).logits


def test_image_embeddings_reach_the_logits(tiny_vision):
    model, tower = tiny_vision
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 28, 56, generator=g), torch.rand(3, 28, 56, generator=g)
    la1, la2, lb = (_prefill_logits(model, tower, x) for x in (a, a, b))
    torch.testing.assert_close(la1, la2, rtol=0, atol=0)                  # same image: same logits
    # text before the image is causal (not bit-exact: chunked KDA and batched matmuls see the whole prompt)
    torch.testing.assert_close(la1[:2], lb[:2], rtol=0, atol=1e-10)
    assert (la1[2:] - lb[2:]).abs().max() > 1e-3                           # different image: different tail


def test_placeholder_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_media_placeholders([9, 1, 9], [4], 9)
    with pytest.raises(ValueError, match="3 image embedding rows for 2 placeholder"):
        stack_media_embeds([torch.zeros(3, 4)], torch.tensor([9, 9, 1]), 9)
