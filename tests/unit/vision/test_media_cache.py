"""The preprocessed-image cache (vLLM's mm processor cache, k3.engine.media_cache): least recently
used entries leave first within the byte budget; in the engine an image sent again takes its
patches from the cache (the same tokens as with the cache off), and the lookups and hits are
counted for /metrics."""

import torch

from k3.cli.checkpoint import init_checkpoint
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.media_cache import PreprocessedImageCache
from k3.engine.params import SamplingParams


def _patches(n: int) -> torch.Tensor:
    return torch.zeros(n, 3, 2, 2)                  # 48 bytes a patch


def test_lru_within_the_byte_budget():
    cache = PreprocessedImageCache(capacity_bytes=48 * 10)
    cache.put(b"a", _patches(4), (2, 2))
    cache.put(b"b", _patches(4), (2, 2))
    assert cache.get(b"a") is not None                # a is now the most recently used
    cache.put(b"c", _patches(4), (2, 2))              # 12 patches > 10: b leaves, not a
    assert (cache.get(b"b"), len(cache), cache.bytes) == (None, 2, 48 * 8)
    assert cache.get(b"a")[1] == (2, 2) and cache.get(b"c") is not None
    cache.put(b"huge", _patches(11), (1, 11))         # larger than the whole budget: not kept
    assert cache.get(b"huge") is None and len(cache) == 2


def test_engine_reuses_preprocessed_images(tmp_path):
    ckpt = init_checkpoint("k3-tiny", tmp_path / "m", progress=False)
    image = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(0))
    other = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(1))
    tokens = {}
    for gb in (4.0, 0.0):
        e = LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, max_model_len=256,
                                   kv_cache_memory_gib=0.02, mm_processor_cache_gb=gb))
        ph = e.model_config.media_placeholder_token_id
        got, patches = [], []
        for rid, img in (("a", image), ("b", image), ("c", other)):
            e.add_request(rid, [5, 6, ph, 7], SamplingParams(max_tokens=2, temperature=0),
                          multi_modal_data={"image": [img]})
            patches.append(e.requests[rid].media.items[0].patches)
            while e.has_unfinished_requests():
                out = e.step()
            got.append(out[0].outputs[0].token_ids)
        stats = e.snapshot()
        assert (stats["mm_cache_queries_total"], stats["mm_cache_hits_total"]) == ((3, 1) if gb else (0, 0))
        assert stats["mm_images_total"] == 3
        assert (patches[1] is patches[0]) == bool(gb) and torch.equal(patches[1], patches[0])   # cached: shared
        tokens[gb] = got
    assert tokens[4.0] == tokens[0.0] and tokens[4.0][0] == tokens[4.0][1]
