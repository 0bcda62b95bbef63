"""Image chat end to end (issue 30 item 1): an OpenAI client's chat completion with an image_url
part on k3-tiny (which has a tiny tower), checked against the offline engine on the same prompt ids
and images; bad images, refused sources and a model without a tower are 400s naming the problem."""

from __future__ import annotations

import base64
import io

try:  # openai >= 3 ships its HTTP client as httpx2
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx
import pytest
import torch
from PIL import Image

from k3.chat.template import chat_prompt_ids
from k3.engine.async_engine import AsyncEngine
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.serve import build_app
from k3.serve.media import MediaOptions
from k3.vision.media import decode_image_bytes

from serve_support import MAX_MODEL_LEN, MODEL, LiveServer


def _png(seed: int, w: int = 60, h: int = 40) -> bytes:
    pixels = torch.randint(0, 256, (h, w, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_openai_client_image_chat_matches_the_offline_engine(client, checkpoint):
    png = _png(0)
    resp = client.chat.completions.create(model=MODEL, messages=_messages(_data_url(png)), max_tokens=4,
                                          temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
    offline = LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", kv_cache_memory_gib=0.02,
                                     max_model_len=MAX_MODEL_LEN, load_progress=False))
    ids = chat_prompt_ids(offline.tokenizer, _messages("x"), thinking=False)
    ph = offline.model_config.media_placeholder_token_id
    assert ids.count(ph) == 1                                   # one placeholder between the media markers
    offline.add_request("r", ids, SamplingParams(max_tokens=4, temperature=0, skip_special_tokens=False),
                        multi_modal_data={"image": decode_image_bytes(png)})
    while offline.has_unfinished_requests():
        out = offline.step()
    tokens = out[0].outputs[0].token_ids
    # 60x40 pixels padded to 84x56 (multiples of 2 x 14) -> a 6x4 patch grid -> 2x2 merged: 6 placeholders
    assert resp.usage.prompt_tokens == len(ids) - 1 + 6 == len(out[0].prompt_token_ids)
    assert resp.usage.completion_tokens == len(tokens)
    assert resp.choices[0].message.content == offline.tokenizer.decode(tokens)


def _post(url: str, messages) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1},
                      timeout=60)


def _error(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]["message"]


def test_bad_images_and_refused_sources_are_400s(server, tmp_path):
    png = _png(1)
    assert "truncated or corrupt" in _error(_post(server.url, _messages(_data_url(png[: len(png) // 2]))))
    assert "not an image type" in _error(_post(server.url, _messages(_data_url(b"hello", "text/plain"))))
    assert "not a recognised image format" in _error(_post(server.url, _messages(_data_url(b"\0" * 64))))
    assert "remote image URLs are not allowed" in _error(_post(server.url, _messages("https://example.com/a.png")))
    (tmp_path / "a.png").write_bytes(png)
    assert "local image files are not allowed" in _error(_post(server.url, _messages(str(tmp_path / "a.png"))))


def test_local_media_path_and_size_limit(engine, tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png(2))
    (tmp_path / "outside.png").write_bytes(_png(2))
    app = build_app(engine, served_model_name=MODEL,
                    media=MediaOptions(allowed_local_media_path=str(allowed), max_bytes=20000))
    with LiveServer(app) as live:
        assert _post(live.url, _messages(f"file://{allowed / 'a.png'}")).status_code == 200
        assert "outside the allowed media path" in _error(_post(live.url, _messages(str(tmp_path / "outside.png"))))
        assert "more than the limit of 20000" in _error(_post(live.url, _messages(_data_url(_png(3, 200, 200)))))


def test_model_without_a_tower_refuses_images(tmp_path):
    from k3.cli.checkpoint import init_checkpoint

    text = init_checkpoint("k3-tiny-text", tmp_path / "t", progress=False)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(text), dtype="float32", kv_cache_memory_gib=0.02,
                                                max_model_len=256, load_progress=False)))
    try:
        with LiveServer(build_app(engine, served_model_name=MODEL)) as live:
            resp = _post(live.url, _messages(_data_url(_png(4))))
            assert "this model takes no images" in _error(resp)
            assert resp.json()["error"]["code"] == "images_not_supported"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad", [{"type": "image_url"}, {"type": "image_url", "image_url": {"url": ""}}])
def test_image_part_without_url_is_a_400(server, bad):
    assert "image_url" in _error(_post(server.url, [{"role": "user", "content": [bad]}]))


def _image_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith(("k3:mm_", "vllm:mm_"))}


def test_image_counters_on_metrics(server):
    """Two requests with one new image: vLLM's processor-cache series count two lookups and one
    hit (the second request's image is already preprocessed); k3's count both images and at least
    the first one's encoder run."""
    before = _image_metrics(server.url)
    url = _data_url(_png(77, 70, 50))                      # an image no other test sends
    for _ in range(2):
        assert _post(server.url, _messages(url)).status_code == 200
    after = _image_metrics(server.url)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vllm:mm_cache_queries_total"] == delta["k3:mm_cache_queries_total"] == 2
    assert delta["vllm:mm_cache_hits_total"] == delta["k3:mm_cache_hits_total"] == 1
    assert delta["k3:mm_images_total"] == 2 and delta["k3:mm_encoder_runs_total"] >= 1
    assert delta["k3:mm_encoder_tokens_total"] >= 6         # 70x50 px: 3x2 merged tokens, encoded at least once
