"""Images beside the features merged from main (LoRA adapters, structured outputs) on
k3-tiny-vision in float64.

References are independent of the combination: an adapter's image request must give what the
same request gives on an engine without prefix caching (so the cached prefix under the adapter's
salt is its own), must not reuse the base model's cached prefix of the same image, and a
constrained image request must decode to one of its choices."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from k3.cli.checkpoint import init_checkpoint
from k3.config import K3Config
from k3.engine.engine import EngineConfig, LLMEngine
from k3.engine.params import SamplingParams
from k3.model import K3ForCausalLM

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_files import write_adapter  # noqa: E402

GREEDY = dict(max_tokens=2, temperature=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-lora")
    ckpt = init_checkpoint("k3-tiny-vision", root / "ckpt", progress=False)
    meta = K3ForCausalLM(K3Config.preset("k3-tiny-vision"), device="meta")
    return ckpt, write_adapter(root / "a", meta, rank=4, seed=1, std=0.2)


def _engine(ckpt, adapter, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float64", load_progress=False, max_model_len=256,
                                  block_size=16, kv_cache_memory_gib=0.02, enable_lora=True,
                                  lora_modules={"a": str(adapter)}, **kw))


def _run(e: LLMEngine, rid: str, ids, image, **params) -> list[int]:
    e.add_request(rid, ids, SamplingParams(**{**GREEDY, **params}), multi_modal_data={"image": [image]})
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                out = o
    return out.outputs[0]


def test_image_requests_under_an_adapter_and_a_grammar(setup):
    ckpt, adapter = setup
    img = torch.rand(3, 56, 84, generator=torch.Generator().manual_seed(0))
    plain = _engine(ckpt, adapter)
    ph = plain.model_config.media_placeholder_token_id
    ids = [5, 17, 40, 41, 42, ph, 200, 201] + list(range(60, 78))
    want_base = _run(plain, "b", ids, img).token_ids
    want_a = _run(plain, "a", ids, img, lora_name="a").token_ids
    assert want_a != want_base                                # the adapter changes the answer (std 0.2)

    cached = _engine(ckpt, adapter, enable_prefix_caching=True, prefix_match_unit=4, kda_checkpoint_interval=8)
    reused = lambda: cached.prefix_cache_stats()["prefix_cache_reused_tokens_total"]  # noqa: E731
    assert _run(cached, "b1", ids, img).token_ids == want_base
    before = reused()
    assert _run(cached, "a1", ids, img, lora_name="a").token_ids == want_a
    assert reused() == before, "the adapter's request must not reuse the base model's cached image prefix"
    assert _run(cached, "a2", ids, img, lora_name="a").token_ids == want_a
    assert reused() > before                                  # its own cached prefix, the same image

    out = _run(plain, "s", ids, img, max_tokens=5, structured_outputs={"choice": ["yes", "no"]})
    assert out.text in ("yes", "no")
