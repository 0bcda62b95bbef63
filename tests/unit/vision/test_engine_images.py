"""Images through the engine (issue 30 items 1 and 3) on k3-tiny-vision in float64.

The reference is the model-level prefill below the engine (tower -> placeholders -> one K3 forward,
as test_image_prefill), not the engine itself: the engine's first greedy token must be its argmax,
whether the prefill runs in one forward or in chunks that cut the image."""
import dataclasses

import pytest
import torch

from k3.cache.pool import CachePool
from k3.cli.checkpoint import init_checkpoint
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.model import contiguous_block_table
from k3.model.metadata import ForwardMetadata
from k3.vision.preprocess import image_to_patches
from k3.vision.prompt import expand_media_placeholders, stack_media_embeds

GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_checkpoint("k3-tiny-vision", tmp_path_factory.mktemp("tv"), progress=False)


def _engine(ckpt, chunk: int | None = None, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory_gib", 0.02)
    e = LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, max_model_len=256,
                               block_size=16, max_num_batched_tokens=chunk or 2048, **kw))
    if chunk:          # no adaptive budget for a lone request: every prefill goes in `chunk`-token pieces
        e.scheduler.config = dataclasses.replace(e.scheduler.config, adaptive_token_limit=0)
    return e


def _image(seed: int, h: int = 56, w: int = 84) -> torch.Tensor:
    return torch.rand(3, h, w, generator=torch.Generator().manual_seed(seed))


def _run(e: LLMEngine, requests) -> dict[str, list[int]]:
    """requests: (id, prompt ids, images or None); greedy tokens by id, all in one batch."""
    for rid, ids, images in requests:
        e.add_request(rid, ids, GREEDY, multi_modal_data={"image": images} if images else None)
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _prompt(e: LLMEngine, n_images: int = 1) -> list[int]:
    ph = e.model_config.media_placeholder_token_id
    return [5, 17, 40, 41, 42] + [ph, 200, 201] * n_images + [3, 9]


def _reference_first_token(e: LLMEngine, ids: list[int], image: torch.Tensor) -> int:
    """argmax of the last position of one model-level prefill with the image's embeddings."""
    model, tower, ph = e.model, e.media.tower, e.model_config.media_placeholder_token_id
    patches, grid = image_to_patches(image, patch_size=14, merge_kernel=2, in_patch_limit=16384,
                                     patch_limit_on_one_side=512)
    (emb,) = tower.encode(patches.to(torch.float64), [grid])
    full = expand_media_placeholders(ids, [emb.shape[0]], ph)
    blocks = (len(full) + 15) // 16
    cache = CachePool.for_model(model, blocks + 1, block_size=16).views
    meta = ForwardMetadata.build([full], context_lens=[0], state_indices=[0],
                                 block_table=contiguous_block_table(1, blocks) + 1, page_size=16)
    logits = model(meta, cache, media_embeds=stack_media_embeds([emb], torch.tensor(full), ph)).logits
    return int(logits[-1].argmax())


def test_image_request_matches_the_model_level_prefill_whole_and_chunked(ckpt):
    img = _image(0, 112, 112)                                    # 4 x 4 merged: 16 placeholders
    whole = _engine(ckpt)
    ids = _prompt(whole)
    want = _reference_first_token(whole, ids, img)
    a = _run(whole, [("a", ids, [img])])["a"]
    chunked = _engine(ckpt, chunk=8)                             # chunks of 8 cut the image at 3, 11
    b = _run(chunked, [("a", ids, [img])])["a"]
    assert a[0] == want and a == b
    assert chunked.media.stats["mm_encoder_runs_total"] == 1     # encoded once, sliced per chunk
    other = _run(whole, [("c", ids, [_image(1, 112, 112)])])["c"]
    assert other != a                                            # the image reaches the tokens


def test_same_image_twice_with_and_without_prefix_caching(ckpt):
    img, other = _image(2), _image(3)
    plain = _engine(ckpt)
    ids = _prompt(plain, 2) + list(range(60, 80))              # 45 tokens: several 4-token units
    imgs = [img, img]
    ref = _run(plain, [("r", ids, imgs)])["r"]
    # KDA checkpoints every 8 tokens: one lands inside the first image (placeholders 5..10)
    cached = _engine(ckpt, enable_prefix_caching=True, prefix_match_unit=4, kda_checkpoint_interval=8)
    first = _run(cached, [("x", ids, imgs)])["x"]
    before = cached.prefix_cache_stats()["prefix_cache_reused_tokens_total"]
    second = _run(cached, [("y", ids, imgs)])["y"]
    reused = cached.prefix_cache_stats()["prefix_cache_reused_tokens_total"] - before
    assert ref == first == second and reused > 20               # the same image shares the prefix
    # a different second image (placeholders from 13): the prefix is reused up to the checkpoint
    # at 8, inside the first image, whose rows 3.. the resumed prefill takes; nothing past 12
    before = cached.prefix_cache_stats()["prefix_cache_reused_tokens_total"]
    diff = _run(cached, [("z", ids, [img, other])])["z"]
    assert cached.prefix_cache_stats()["prefix_cache_reused_tokens_total"] - before == 8
    assert diff == _run(plain, [("z", ids, [img, other])])["z"] != second


def test_image_request_in_a_batch_leaves_text_requests_unchanged(ckpt):
    e = _engine(ckpt)
    texts = [("t0", [5, 6, 7, 8, 9, 10], None), ("t1", list(range(30, 52)), None)]
    text_only = _run(e, texts)
    mixed = _run(e, [texts[0], ("i", _prompt(e), [_image(4)]), texts[1]])
    assert {k: mixed[k] for k in text_only} == text_only and len(mixed["i"]) == 3


def test_encoder_budget_outputs_freed_and_refusals(ckpt, tmp_path):
    e = _engine(ckpt, max_num_encoder_tokens=6)                  # one 6-token image per step
    ids = _prompt(e, 2)
    e.add_request("a", ids, GREEDY, multi_modal_data={"image": [_image(5), _image(6)]})
    media = e.requests["a"].media
    e.step()
    assert len(media.embeds) == 1 and e.requests["a"].num_computed_tokens == 13   # stopped before image 2
    e.step()
    assert len(media.embeds) == 2
    e.abort_request("a")
    assert media.embeds == {}                                    # freed with the request
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        e.add_request("b", ids, GREEDY, multi_modal_data={"image": [_image(5)]})
    with pytest.raises(ValueError, match="more than the encoder budget"):
        e.add_request("c", _prompt(e), GREEDY, multi_modal_data={"image": [_image(5, 112, 112)]})
    text = init_checkpoint("k3-tiny-text", tmp_path / "t", progress=False)
    with pytest.raises(ValueError, match="this model takes no images"):
        LLMEngine(EngineConfig(model=str(text), dtype="float64", load_progress=False, kv_cache_memory_gib=0.02,
                               max_model_len=256)).add_request("d", ids, GREEDY,
                                                               multi_modal_data={"image": [_image(5)]})


def test_offline_llm_chat_and_generate_take_images(ckpt):
    import base64
    import io

    from PIL import Image

    from k3 import LLM
    from k3.chat.template import chat_prompt_ids
    from k3.vision.media import decode_image_bytes

    pixels = torch.randint(0, 256, (40, 60, 3), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "describe"}]}]
    llm = LLM(str(ckpt), dtype="float64", kv_cache_memory_gib=0.02, max_model_len=512, load_progress=False)
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    ids = chat_prompt_ids(llm.get_tokenizer(), messages)
    gen = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": decode_image_bytes(buf.getvalue())}},
                       GREEDY, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
    assert len(chat.prompt_token_ids) == len(ids) + 5                 # one placeholder became 6
